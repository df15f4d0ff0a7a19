"""nbddp export: the notebook's %%ddp cells run under torchrun and print what the cell showed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nbddp.export import export_cells

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
    assert "_out = y.item()\nif rank == 0:\n    print(repr(_out))" in script
    assert script.index("def scale") < script.index("_nbddp_process_group()\n") < script.index("y = scale(X)")
    compile(script, "train.py", "exec")


def test_export_without_ddp_cells_says_so():
    with pytest.raises(ValueError, match="no %%ddp cell"):
        export_cells(["x = 1"], source="nb.ipynb")
