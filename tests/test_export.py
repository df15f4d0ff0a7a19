"""nbddp export: the notebook's %%ddp cells run under torchrun and print what the cell showed."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.export.script import export_cells
from nbddp.export.pysyntax import to_python

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
    run = subprocess.run([bindir / "torchrun", "--standalone", "--nproc-per-node", "2", script],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == cell_result(NOTEBOOK)


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
        line = re.sub(r"^\[rank\d+\]:", "", line)
        line = re.sub(r"^(CPU times|Wall time): .*", r"\1: ...", line)
        if line.strip():
            out.append(line)
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
    bindir = Path(sys.executable).parent
    logs = tmp_path / "logs"  # one file per rank: torchrun's shared stdout interleaves ranks mid-line
    run = subprocess.run([bindir / "torchrun", "--standalone", "--nproc-per-node", "2", "--redirects", "1",
                          "--log-dir", logs, script], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = "".join(p.read_text() for p in sorted(logs.rglob("stdout.log")))
    assert _lines(printed) == notebook, (printed, shown)


def test_ipython_syntax_becomes_plain_python():
    code, needs = to_python("files = !ls {path}\n!echo $x\n%env A=1\n%cd /tmp\n%matplotlib inline\n"
                            "y = %time f(x)\nfor i in range(2):\n    %timeit g(i)\n")
    compile(code, "cell", "exec")
    assert "get_ipython" not in code and needs == {"subprocess"}
    assert "files = subprocess.run(f'ls {path}', shell=True, capture_output=True, text=True).stdout.splitlines()" in code
    assert "subprocess.run(f'echo {x}', shell=True)  # !echo $x" in code
    assert "os.environ['A'] = '1'" in code and "os.chdir(os.path.expanduser('/tmp'))" in code
    assert "pass  # (notebook only) %matplotlib inline" in code and "y = f(x)" in code
    assert "\n    g(i)  # %timeit" in code
    code, needs = to_python("%%capture\nprint('hidden')\n")
    assert "redirect_stdout" in code and needs == {"io"}


def test_help_and_export_cells_are_skipped_and_print_adds_no_none():
    script = export_cells(["%%ddp?", "x?", "%%ddp --devices 2\nprint(rank)", "%ddp_export t.py"])
    assert script.count("# --- %%ddp cell") == 1 and "print(rank)\n" in script
    assert "_nbddp_show(print" not in script and "ddp_export" not in script
    compile(script, "train.py", "exec")


def test_a_cell_using_ipython_syntax_still_pulls_in_the_data_it_needs():
    script = export_cells(["X = torch.ones(3)", "X[0] = 5", "unrelated = 1", "%%ddp --devices 2\n!echo hi\nprint(X)"])
    assert "X = torch.ones(3)" in script and "X[0] = 5" in script and "unrelated" not in script
