"""The saved tutorials test anywhere (issue 35): no output names the machine that built them (an absolute
path: a home, the checkout, /tmp, a venv's site-packages) or carries a library's warning, which strict nbval
would compare on every other machine. notebooks/_build.py refuses to save such an output; this checks
what is committed."""
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MACHINE = re.compile(r"(?<![\w.~])/(?:home|work|tmp|root|usr)/|site-packages")
WARNING = re.compile(r"\b\w*Warning: ")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_outputs_hold_no_machine_path_and_no_library_warning(path):
    bad = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        for out in cell.get("outputs", []):
            text = json.dumps(out, ensure_ascii=False)
            bad += [f"cell {i}: …{text[max(0, m.start() - 60):m.end() + 60]}…"
                    for m in [*MACHINE.finditer(text), *WARNING.finditer(text)]]
    assert not bad, "\n".join(bad[:5])


def test_the_build_refuses_such_an_output():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build", NOTEBOOKS[0].parent / "_build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import x")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text=(
        "[rank1]:/work/main/.venv/lib/python3.11/site-packages/lib/x.py:21: DeprecationWarning: old\n"))]
    assert len(build.machine_bound(nb)) >= 2  # the path and the warning
    home = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    home.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                    text=f"logs: {Path.home()}/.cache/nbddp/runs/1\n")]
    build.without_home(home)
    assert home.cells[0].outputs[0]["text"] == "logs: ~/.cache/nbddp/runs/1\n" and not build.machine_bound(home)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_magic_is_the_first_line_of_its_cell(path):
    """A cell magic below another line (an nbval marker put first) is not a cell magic: IPython says
    "Line magic function `%%ddp` not found", and nbval's NBVAL_RAISES_EXCEPTION would accept that as the
    failure the tutorial meant to show. Markers go after the magic's line."""
    bad = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
        lines = source.splitlines()
        if any(line.startswith("%%") for line in lines[1:]):
            bad.append(f"cell {i}: {lines[0]!r} comes before its cell magic")
        for out in cell.get("outputs", []):
            if "magic function" in json.dumps(out) and "not found" in json.dumps(out):
                bad.append(f"cell {i}: its saved output says a magic was not found")
    assert not bad, "\n".join(bad)
