"""nbddp export: the notebook's %%ddp cells run under torchrun and print what the cell showed."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.export.pysyntax import to_python
from nbddp.export.script import export_cells
from torchrun import torchrun

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "06-export-to-torchrun.ipynb"


def cell_result(notebook: Path) -> str:
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] == "code" and "".join(cell["source"]).startswith("%%ddp"):
            for out in cell["outputs"]:
                if out["output_type"] == "execute_result":
                    return "".join(out["data"]["text/plain"])
    raise AssertionError("the notebook's %%ddp cell has no saved result")


def test_exported_notebook_under_torchrun_prints_the_cells_result(tmp_path):
    script = tmp_path / "train.py"
    bindir = Path(sys.executable).parent
    subprocess.run([bindir / "nbddp", "export", NOTEBOOK, "-o", script], check=True, timeout=60)
    run = torchrun(script, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == cell_result(NOTEBOOK)


@pytest.mark.unit
def test_export_keeps_only_the_cells_the_ddp_cells_need():
    cells = [
        "%load_ext nbddp",
        "import torch\nimport json",
        "X = torch.randn(10, 2)",
        "unrelated = 42\nprint(unrelated)",
        "def scale(t):\n    return t * 2",
        "%%ddp --devices 4 --out y\ny = scale(X).sum()\ny.item()",
        "print(y)",
    ]
    script = export_cells(cells, source="nb.ipynb")
    assert "X = torch.randn(10, 2)" in script and "def scale" in script and "import torch\nimport json" in script
    assert "unrelated" not in script and "print(y)" not in script
    assert "# (notebook only) %load_ext nbddp" not in script  # not needed by the %%ddp cell
    assert "--nproc-per-node 4" in script
    assert "_nbddp_show(y.item())" in script
    assert script.index("def scale") < script.index("_nbddp_process_group()\n") < script.index("y = scale(X)")
    compile(script, "train.py", "exec")


@pytest.mark.unit
def test_export_without_ddp_cells_says_so():
    with pytest.raises(ValueError, match="no %%ddp cell"):
        export_cells(["x = 1"], source="nb.ipynb")


# -- IPython syntax, help cells, printing and random data (issue 10, point 5) -------------------------
NOTEBOOK_CELLS = [
    "import numpy as np\nZ = torch.rand(8)\nN = np.random.rand(3)",  # unseeded: the notebook's ranks saw one copy
    "torch.manual_seed(0)\nX = torch.randn(64, 4)\ncols = !echo {X.shape[1]}\nprint('setup', tuple(X.shape))\nX.shape",
    "X?",
    "%%ddp?",
    "%%ddp --devices 2\n"
    "import torch.distributed as dist\n"
    "!echo shell rank $rank\n"
    "%time s = X.sum()\n"
    "z = [torch.zeros(8) for _ in range(world_size)]\n"
    "dist.all_gather(z, Z)\n"
    "n = [None] * world_size\n"
    "dist.all_gather_object(n, N.tolist())\n"
    "print('Z and N same on every rank:', all(torch.equal(t, z[0]) for t in z), n[0] == n[1], cols)",
    "%%ddp --devices 2\nround(X.sum().item(), 3)",
]


def _lines(text: str) -> list[str]:
    """Output lines without rank prefixes, timings masked, in a fixed order (ranks interleave freely)."""
    out = []
    for line in text.splitlines():
        span = re.match(r"\[rank([\d,-]+)\]:", line)  # a line every rank printed may be shown once: [rank0-1]:
        copies = sum(int(b) - int(a) + 1 for a, _, b in (p.partition("-") if "-" in p else (p, "", p)
                                                        for p in span.group(1).split(","))) if span else 1
        line = re.sub(r"^\[rank[\d,-]+\]:", "", line)
        line = re.sub(r"^(CPU times|Wall time): .*", r"\1: ...", line)
        if line.strip():
            out += [line] * copies
    return sorted(out)


def test_an_exported_session_prints_under_torchrun_what_the_notebook_printed(kernel, tmp_path):
    shown = []
    for cell in NOTEBOOK_CELLS:
        res = kernel.ok(cell, timeout=120)
        shown.append(res.stdout + (res.result + "\n" if res.result else ""))
    notebook = _lines("".join(shown))
    assert "Z and N same on every rank: True True ['4']" in notebook and "torch.Size([64, 4])" in notebook
    script = tmp_path / "train.py"
    kernel.ok(f"%ddp_export {script}")
    text = script.read_text()
    assert "get_ipython" not in text and "%%ddp?" not in text and "pinfo" not in text
    logs = tmp_path / "logs"  # one file per rank: torchrun's shared stdout interleaves ranks mid-line
    run = torchrun(script, timeout=240, cwd=tmp_path, log_dir=logs)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    assert _lines(printed) == notebook, (printed, shown)


@pytest.mark.unit
def test_ipython_syntax_becomes_plain_python():
    code, needs = to_python("files = !ls {path}\n!echo $x\n%env A=1\n%cd /tmp\n%matplotlib inline\n"
                            "y = %time f(x)\nfor i in range(2):\n    %timeit g(i)\n")
    compile(code, "cell", "exec")
    assert "get_ipython" not in code and needs == {"subprocess"}
    assert ("files = subprocess.run(f'ls {path}', shell=True, capture_output=True, text=True).stdout.splitlines()"
            in code)
    assert "subprocess.run(f'echo {x}', shell=True)  # !echo $x" in code
    assert "os.environ['A'] = '1'" in code and "os.chdir(os.path.expanduser('/tmp'))" in code
    assert "pass  # (notebook only) %matplotlib inline" in code and "y = f(x)" in code
    assert "\n    g(i)  # %timeit" in code
    code, needs = to_python("%%capture\nprint('hidden')\n")
    assert "redirect_stdout" in code and needs == {"io"}


@pytest.mark.unit
def test_help_and_export_cells_are_skipped_and_print_adds_no_none():
    script = export_cells(["%%ddp?", "x?", "%%ddp --devices 2\nprint(rank)", "%ddp_export t.py"])
    assert script.count("# --- %%ddp cell") == 1 and "print(rank)\n" in script
    assert "_nbddp_show(print" not in script and "ddp_export" not in script
    compile(script, "train.py", "exec")


@pytest.mark.unit
def test_a_cell_using_ipython_syntax_still_pulls_in_the_data_it_needs():
    script = export_cells(["X = torch.ones(3)", "X[0] = 5", "unrelated = 1", "%%ddp --devices 2\n!echo hi\nprint(X)"])
    assert "X = torch.ones(3)" in script and "X[0] = 5" in script and "unrelated" not in script


# -- export that runs (issue 21, point 5) ----------------------------------------------------------
@pytest.mark.unit
def test_the_last_expression_is_wrapped_alone_comments_and_lines_kept():
    from nbddp.export.script import _with_result

    cases = {
        "loss.item()   # rank 0's last expression (a comment)": "_nbddp_show(loss.item())   # rank 0's last expression "
             "(a comment)",
        "x = 1; (x,\n  x + 1)  # two lines\n": "x = 1; _nbddp_show((x,\n  x + 1))  # two lines",
        "f(1,\n  2)\n# a comment after it\n": "_nbddp_show(f(1,\n  2))\n# a comment after it",
        "s = 'é'; len(s + 'é')  # UTF-8 before the expression": "s = 'é'; _nbddp_show(len(s + 'é'))  # UTF-8 before "
             "the expression",
        "x;  # quiet, as IPython is": "x;  # quiet, as IPython is",
        "x = 1\ny = 2": "x = 1\ny = 2",
    }
    for body, wrapped in cases.items():
        assert _with_result(body) == wrapped
        compile(_with_result(body), "cell", "exec")


@pytest.mark.unit
def test_cells_that_failed_are_left_out_with_a_comment(tmp_path):
    from nbddp.export.script import notebook_cells

    cells = ["import torch", "X = torch.ones(3).summ()", "X = torch.ones(3)", "%%ddp --devices 2\nX.summ()",
             "%%ddp --devices 2\nprint(X.sum())"]
    script = export_cells(cells, failed={1: "AttributeError: 'Tensor' object has no attribute 'summ'\nmore",
                                         3: "AttributeError: ..."})
    assert all(line.startswith("#") for line in script.splitlines() if "summ" in line)  # only as comments
    assert "# --- cell 2 left out: it failed in the session (AttributeError: 'Tensor' object has no attribute " \
           "'summ') ---\n#     X = torch.ones(3).summ()\n" in script
    assert "# --- cell 4 left out" in script and "print(X.sum())" in script
    compile(script, "train.py", "exec")
    with pytest.raises(ValueError, match="no %%ddp cell to export that ran without an error"):
        export_cells(["%%ddp\nboom"], failed={0: "NameError"})
    saved = tmp_path / "nb.ipynb"  # a saved notebook: the cells that show an error are the failed ones
    code = [{"cell_type": "code", "source": c, "outputs": []} for c in ("X = 1", "X.summ()", "%%ddp\nprint(X)")]
    code[1]["outputs"] = [{"output_type": "error", "ename": "AttributeError", "evalue": "no summ", "traceback": []}]
    saved.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": "# hi"}] + code}))
    assert notebook_cells(saved) == (["X = 1", "X.summ()", "%%ddp\nprint(X)"], {1: "AttributeError: no summ"})


def readme_cells() -> list[str]:
    """The README's own example: the python blocks of its "In a notebook" section before the prose."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## In a notebook", 1)[1].split("\nPlots and rich outputs", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_the_readmes_example_exported_from_a_session_runs_under_torchrun(runs_dir, tmp_path):
    """The README's cells in a fresh kernel, with a typo cell the user fixed (it failed: left out), then
    %ddp_export, then real torchrun: rank 0's Out[n] and both ranks' loss lines."""
    from kernel import Kernel

    setup, train = readme_cells()
    assert "%%ddp --devices 2 --out state" in train and "loss.item()   " in train  # the comment that broke it
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok(setup, timeout=120)
        typo = k.run("Y = Y.summ()")
        assert typo.error and typo.error["ename"] == "AttributeError"
        res = k.ok(train, timeout=240)
        printed = _lines(res.stdout)  # one loss line from each rank
        assert len(printed) == 2 and all(re.fullmatch(r"loss \d\.\d{3}", line) for line in printed), res.stdout
        assert re.fullmatch(r"\d\.\d+(e-\d+)?", res.result), res.result
        script = tmp_path / "train.py"
        k.ok(f"%ddp_export {script}")
    text = script.read_text()
    assert "# --- cell 2 left out: it failed in the session (AttributeError: 'Tensor' object has no attribute " \
           "'summ') ---" in text
    assert re.search(r"\n_nbddp_show\(loss\.item\(\)\) +# rank 0's last expression", text)
    logs = tmp_path / "logs"
    run = torchrun(script, timeout=280, cwd=tmp_path, log_dir=logs)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {int(p.parent.name): p.read_text() for p in logs.rglob("stdout.log")}
    assert re.fullmatch(r"loss \d\.\d{3}\n\d\.\d+(e-\d+)?\n", out[0]), out
    assert re.fullmatch(r"loss \d\.\d{3}\n", out[1]), out


def test_a_notebook_that_made_accelerates_state_in_the_kernel_exports_a_script_that_runs(tmp_path):
    """PartialState() in a plain cell made no group in the kernel; under torchrun every process runs that cell
    first and it makes the group: the script's own setup uses it (and a cell's own init joins), never a
    second init ("trying to initialize the default process group twice!")."""
    pytest.importorskip("accelerate")
    cells = ["%load_ext nbddp",
             "from accelerate import PartialState\nstate = PartialState(cpu=True)  # CPU ranks: its MULTI_CPU "
             "path\nprint('processes', state.num_processes)",
             "%%ddp --devices 2\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
             "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
             "print(f'rank {rank} of {world_size}: index {state.process_index}, sum {t.item()}')"]
    script = tmp_path / "train.py"
    script.write_text(export_cells(cells, script="train.py"))
    logs = tmp_path / "logs"
    run = torchrun(script, timeout=240, cwd=tmp_path, log_dir=logs)
    out = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    assert run.returncode == 0 and "twice" not in run.stderr, run.stderr[-3000:]
    assert "rank 0 of 2: index 0, sum 3.0" in out and "rank 1 of 2: index 1, sum 3.0" in out, out
    assert "processes 2" in out, out  # the plain cell, on rank 0 only, saw torchrun's group
