"""%ddp_export of a session as users run one (issue 42, points 1-2): each notebook cell once, as it last ran
without an error, known by the front end's cell id or by its text; and a script that runs to its end under
real torchrun whatever the cells did with process groups."""
import re

import pytest

from nbddp.export.script import export_cells
from nbddp.kernel.names.history import History, request_metadata
from torchrun import torchrun

pytestmark = pytest.mark.timeout(600)

# a torchrun-style script pasted into a cell: its own group, DDP, a DistributedSampler, destroy at the end
PASTED = '''%%ddp --devices 2
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    init_process_group(backend="gloo")
    model = DDP(torch.nn.Linear(4, 1))
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    print(f"pasted script done on rank {dist.get_rank()}", flush=True)
    destroy_process_group()
    return model


trained = main()
'''

REMADE = '''%%ddp --devices 2
import torch.distributed as dist
t = torch.ones(1)
dist.destroy_process_group()
dist.init_process_group("gloo")
dist.all_reduce(t)
dist.destroy_process_group()
dist.init_process_group(backend="gloo", init_method="env://")
dist.all_reduce(t)
print(f"group made again twice: {t.item()}")
'''


def ran(history: History, source: str, number: int, cell_id=None, error=None, deleted=()) -> None:
    history.started(source, cell_id, deleted)
    history.ended(source, number, error)


@pytest.mark.unit
def test_each_cell_once_as_last_run_in_the_order_cells_first_ran():
    h = History()
    ran(h, "import torch", 1)  # no id: known by its text
    for n in range(2, 14):
        ran(h, PASTED, n)  # 12 runs, unchanged
    ran(h, "x = 1", 14, cell_id="a")
    ran(h, "x = 2 + y", 15, cell_id="a", error="NameError: name 'y' is not defined")
    ran(h, "%%ddp\nprint('v1')", 16, cell_id="b")
    ran(h, "%%ddp\nprint('v2')", 17, cell_id="b")
    ran(h, "%%ddp\nprint('gone')", 18, cell_id="c")
    ran(h, "%%ddp\nboom", 19, cell_id="d", error="NameError: name 'boom' is not defined")
    ran(h, "import torch", 20, cell_id="e")  # first seen without an id, now with one: the same cell
    ran(h, "%%ddp\nprint('v3')", 21, cell_id="b", deleted=["c"])  # JupyterLab: c was deleted since
    out = h.export()
    assert out.cells == ["import torch", PASTED, "x = 1", "%%ddp\nprint('v3')", "%%ddp\nboom"]
    assert out.failed == {4: "NameError: name 'boom' is not defined"}
    notes = dict((what.split(":")[0], (i, what)) for i, what in out.left_out)
    assert notes["In [2]-[12]"] == (1, "In [2]-[12]: superseded by In [13] of the same cell (cell 2 below)")
    assert notes["In [15]"] == (2, "In [15]: failed (NameError: name 'y' is not defined); cell 3 below is its In [14]")
    assert notes["In [16], [17]"][0] == 3 and notes["In [18]"] == (None,
                                                                   "In [18]: the cell was deleted in the notebook")
    assert notes["In [1]"][1].startswith("In [1]: superseded by In [20]")
    ran(h, "%%ddp\nprint('gone')", 22, cell_id="c")  # run again (undo, then run): back in its place
    assert h.export().cells[4] == "%%ddp\nprint('gone')"
    h.started("y = 1\n", "f")
    h.ended("x = 1", 23, "SyntaxError")  # not the cell that started (IPython refused it before it ran)
    h.ended(None, 24, "NameError: z")  # an IPython that does not say which cell: the one that started
    assert h.export().failed[6] == "NameError: z"


@pytest.mark.unit
def test_the_header_says_which_runs_were_left_out_and_the_order():
    h = History()
    ran(h, "X = 1", 1, cell_id="x")
    ran(h, "%%ddp --devices 2\nprint(X)", 2, cell_id="p")
    ran(h, "%%ddp --devices 2\nprint(X, rank)", 3, cell_id="p")
    ran(h, "unused = 1", 4, cell_id="u")
    ran(h, "unused = 2", 5, cell_id="u")  # a cell the script does not need: nothing said of it
    out = h.export()
    script = export_cells(out.cells, failed=out.failed, left_out=out.left_out)
    assert "# Each notebook cell once, as it last ran without an error, in the order the cells first ran" in script
    assert "#   In [2]: superseded by In [3] of the same cell (cell 2 below)\n" in script
    assert "In [4]" not in script and "print(X)\n" not in script and script.count("print(X, rank)") == 1
    compile(script, "train.py", "exec")
    assert "first ran" not in export_cells(out.cells)  # a saved notebook's cells: its own order


@pytest.mark.unit
def test_request_metadata_from_ipython_or_the_kernels_parent():
    class Info:
        cell_meta = {"cellId": "abc", "deletedCells": ["z"]}

    class Kernel:
        def get_parent(self, channel=None):
            return {"metadata": {"cellId": "from-parent"}, "content": {"code": "x"}}

    class Shell:
        kernel = Kernel()

    assert request_metadata(None, Info()) == Info.cell_meta
    assert request_metadata(Shell(), object()) == {"cellId": "from-parent"}
    assert request_metadata(object(), None) == {}


def execute(kernel, code: str, cell_id: str | None = None, deleted=(), timeout: float = 240):
    """A cell as JupyterLab sends it: its id (and the cells deleted since the last request) in the
    execute_request's metadata."""
    kc = kernel.kc
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": False}
    metadata = {"deletedCells": list(deleted), "recordTiming": False}
    if cell_id is not None:
        metadata["cellId"] = cell_id
    msg = kc.session.msg("execute_request", content, metadata=metadata)
    kc.shell_channel.send(msg)
    return kernel.collect(msg["header"]["msg_id"], timeout)


def ok(kernel, code: str, cell_id: str | None = None, deleted=(), timeout: float = 240):
    res = execute(kernel, code, cell_id, deleted, timeout)
    assert res.error is None, res.error_text + "\n" + res.stderr
    return res


def test_an_iterated_session_exports_each_cell_once_and_runs_under_torchrun(clean_kernel, tmp_path):
    """The session of issue 42: a DDP cell, a pasted torchrun script run 12 times while iterating, a cell
    that makes, destroys and makes again its own group, accelerate's PartialState and a Lightning Trainer,
    a typo, a cell edited and run three times, a deleted cell, DDP after; exported, then real torchrun."""
    pytest.importorskip("pytorch_lightning")
    k = clean_kernel
    ok(k, "import logging, warnings\nimport pytorch_lightning as pl\n"
          "logging.getLogger('pytorch_lightning').setLevel(logging.WARNING)\n"
          "warnings.filterwarnings('ignore')\n"
          "class Regression(pl.LightningModule):\n"
          "    def __init__(self):\n"
          "        super().__init__()\n"
          "        self.layer = torch.nn.Linear(4, 1)\n"
          "    def training_step(self, batch, _):\n"
          "        x, y = batch\n"
          "        return torch.nn.functional.mse_loss(self.layer(x), y)\n"
          "    def configure_optimizers(self):\n"
          "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
          "data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))", "setup")
    ddp = ("%%ddp --devices 2\nnet = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))\n"
           "net(torch.ones(2, 4)).sum().backward()\nprint('DDP {when}')")
    ok(k, ddp.format(when="before"), "ddp-before")
    for _ in range(12):  # iterating on the pasted script; this front end sends no id: known by its text
        res = ok(k, PASTED)
    assert "pasted script done on rank 1" in res.stdout, res.stdout
    assert "group made again twice: 4.0" in ok(k, REMADE, "remade").stdout
    state = ok(k, "%%ddp --devices 2\nfrom accelerate import PartialState\nstate = PartialState(cpu=True)\n"
                  "print(f'PartialState {state.process_index} of {state.num_processes}')", "partialstate")
    assert "PartialState 1 of 2" in state.stdout, state.stdout
    trainer = ("%%ddp --devices 2\n"
               "trainer = pl.Trainer(accelerator='cpu', devices=world_size, strategy='ddp', max_epochs=1, "
               "logger=False,\n"
               "                     enable_checkpointing=False, enable_progress_bar=False, "
               "enable_model_summary=False)\n"
               "trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=16))\n"
               "print(f'Trainer rank {trainer.global_rank} of {trainer.world_size}')")
    assert "Trainer rank 1 of 2" in ok(k, trainer, "trainer").stdout
    typo = execute(k, "%%ddp --devices 2\nprint(undefined_name)", "typo")
    assert typo.error is not None
    for version in (1, 2, 3):  # one cell, edited and run again
        ok(k, f"%%ddp --devices 2\nprint('edited cell, version {version}')", "edited")
    ok(k, "%%ddp --devices 2\nprint('a cell deleted later')", "deleted")
    ok(k, ddp.format(when="after"), "ddp-after", deleted=["deleted"])
    script = tmp_path / "train.py"
    ok(k, f"%ddp_export {script}", "export")

    text = script.read_text()
    body = text.split("_nbddp_group_calls()\n", 1)[1]  # the cells, after the script's own helpers
    assert body.count("def main():") == 1 and body.count("print('DDP before')") == 1, text
    assert "version 3" in body and "version 1" not in body and "version 2" not in body
    assert "a cell deleted later" not in body and "print(undefined_name)" not in body.replace("#     print", "")
    assert re.search(r"#   In \[\d+\]-\[\d+\]: superseded by In \[\d+\] of the same cell", text), text[:3000]
    assert re.search(r"#   In \[\d+\]: the cell was deleted in the notebook", text)
    assert re.search(r"# --- cell \d+ left out: it failed in the session \(.*NameError: name 'undefined_name'", text)
    assert re.search(r"#   In \[\d+\]: failed \(.*NameError: name 'undefined_name' is not defined\); cell \d+ below, a "
                     r"comment", text)
    assert body.index("DDP before") < body.index("def main") < body.index("made again") < body.index("Trainer(") \
        < body.index("version 3") < body.index("DDP after")

    logs = tmp_path / "logs"
    run = torchrun(script, timeout=300, cwd=tmp_path, log_dir=logs)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {int(p.parent.name): p.read_text() for p in logs.rglob("stdout.log")}
    for rank in (0, 1):
        for line in ("DDP before", f"pasted script done on rank {rank}", "group made again twice: 4.0",
                     f"PartialState {rank} of 2", f"Trainer rank {rank} of 2", "edited cell, version 3", "DDP after"):
            assert out[rank].count(line) == 1, (rank, line, out[rank])


def test_cells_that_make_and_destroy_groups_many_times_run_to_the_end_under_torchrun(tmp_path):
    """Twelve different torchrun-style cells (as a notebook whose cells are copies), each its own init and
    destroy, and a cell making its group again twice: each init after a destroy is a new group; no hang."""
    cells = ["import torch"] + [PASTED.replace("def main", f"# copy {n}\ndef main") for n in range(12)]
    cells += [REMADE, "%%ddp --devices 2\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                      "print('after', t.item())"]
    script = tmp_path / "train.py"
    script.write_text(export_cells(cells, script="train.py"))
    logs = tmp_path / "logs"
    run = torchrun(script, timeout=240, cwd=tmp_path, log_dir=logs)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {int(p.parent.name): p.read_text() for p in logs.rglob("stdout.log")}
    assert out[0].count("pasted script done on rank 0") == 12 and out[1].count("pasted script done on rank 1") == 12
    assert "group made again twice: 4.0" in out[1] and "after 2.0" in out[0], out
