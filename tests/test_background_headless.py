"""Background cells (``%%ddp --bg``) in a notebook run headless, top to bottom, by nbclient (as nbval,
papermill and Kaggle's "Save & Run All" run it): the cells after a background cell run while it trains, a
cell that reads its --gather name waits for it and gets it, ``%ddp wait`` waits for the rest, and the
numbers are the ones the same cell gives without --bg. A background failure fails the run at ``%ddp wait``
(or at a cell that reads what it would have brought back). The kernel is shut down and no process is left.

The training cell starts only once the plot cell ran (a file the plot cell writes): proof that the notebook
was free while the ranks had the cell, whatever the machine's speed."""
from __future__ import annotations

import json
import math

import nbformat
import psutil
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.timeout(240)

STEPS = 3 * 16  # 3 epochs of 16 batches of 64 (2048 rows over 2 ranks)

DATA = """%load_ext nbddp
import pathlib, torch
torch.manual_seed(0)
X = torch.randn(2048, 8)
Y = X @ torch.randn(8, 1) + 0.1 * torch.randn(2048, 1)
PLOTTED = pathlib.Path({marker!r})"""

TRAIN = """%%ddp{bg} --gather losses
import time
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
while not PLOTTED.exists():  # (the test's proof that the notebook ran a cell meanwhile)
    time.sleep(0.02)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(X, Y)
sampler = DistributedSampler(data, shuffle=True, seed=0)  # each rank its half, reshuffled each epoch
losses = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    for xb, yb in DataLoader(data, batch_size=64, sampler=sampler):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        time.sleep(0.05)  # a few seconds of training{fail}"""

FAIL = """
        if rank == 1 and len(losses) == 10:
            time.sleep(2)
            raise ValueError('bad batch on rank 1')"""

PLOT = """import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))
left.hist(Y.squeeze().numpy(), bins=40)
right.scatter(X[:, 0].numpy(), Y.squeeze().numpy(), s=2)
fig.savefig(PLOTTED.with_suffix('.png'))
plt.close(fig)
print(f'Y: mean {Y.mean():.3f}, std {Y.std():.3f}')
PLOTTED.touch()"""

READ = """print('steps', [len(curve) for curve in losses])
print('LOSSES', __import__('json').dumps(losses))"""


def cells(marker, bg: bool, fail: bool = False, read: bool = True) -> list:
    code = nbformat.v4.new_code_cell
    out = [code(DATA.format(marker=str(marker))),
           code("%ddp start --devices 2 --seed 0"),
           code(TRAIN.format(bg=" --bg" if bg else "", fail=FAIL if fail else "")),
           code(PLOT)]
    if not fail:
        out.append(code("%ddp status"))
    if read:
        out.append(code(READ))
    return out + [code("%ddp wait"), code("%ddp stop")]


class Run:
    """One notebook executed by nbclient; the kernel's process and every process it had (sampled as each
    cell ended) kept, to check that none outlives the run."""

    def __init__(self, cells, cwd):
        self.nb = nbformat.v4.new_notebook(cells=cells)
        self.nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        self.kernel: psutil.Process | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.left_after_cell: dict[int, list] = {}  # cell index -> processes under the kernel as it ended
        self.client = NotebookClient(self.nb, timeout=120, startup_timeout=60, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}},
                                     on_notebook_start=self._started, on_cell_executed=self._cell_ended,
                                     on_cell_error=self._cell_ended)

    def _started(self, notebook):
        self.kernel = psutil.Process(self.client.km.provisioner.process.pid)

    def _cell_ended(self, cell, cell_index, execute_reply):
        kids = self.kernel.children(recursive=True)
        self.seen.update({p.pid: p for p in kids})
        self.left_after_cell[cell_index] = kids

    def execute(self):
        try:
            self.client.execute()
        finally:
            self.assert_nothing_left()

    def assert_nothing_left(self):
        """The kernel was shut down, and every process it had is gone (none is reparented and left)."""
        procs = [p for p in [self.kernel, *self.seen.values()] if p is not None]
        _, alive = psutil.wait_procs(procs, timeout=20)
        assert not alive, f"left behind: {[(p.pid, p.name(), p.status()) for p in alive]}"

    def outputs(self, index: int, name: str | None = None) -> str:
        return "".join(o.get("text", "") for o in self.nb.cells[index].outputs
                       if o.output_type == "stream" and (name is None or o.name == name))


def losses_of(run: Run, index: int) -> list:
    line = next(ln for ln in run.outputs(index, "stdout").splitlines() if ln.startswith("LOSSES "))
    return json.loads(line[len("LOSSES "):])


def test_a_background_training_cell_in_a_headless_run_gives_what_the_blocking_cell_gives(runs_dir, tmp_path):
    bg = Run(cells(tmp_path / "bg-plotted", bg=True), tmp_path)
    bg.execute()  # CellExecutionError on any error

    sent, plot, status, read, wait, stop = range(2, 8)
    assert "background cell [3] sent: the notebook is free" in bg.outputs(sent, "stderr")
    assert bg.seen, "no rank process was ever seen"
    assert (tmp_path / "bg-plotted.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot, made meanwhile
    assert "Y: mean" in bg.outputs(plot, "stdout")
    assert "[3] running" in bg.outputs(status, "stdout"), bg.outputs(status)  # it trained after the plot
    said = bg.outputs(read, "stderr")
    assert "this cell reads losses, which background cell [3] brings back: waiting for it" in said, said
    assert "background cell [3] ended: losses arrived in the notebook" in said, said
    assert bg.outputs(read, "stdout").startswith(f"steps [{STEPS}, {STEPS}]\n"), bg.outputs(read)
    got = losses_of(bg, read)
    assert len(got) == 2 and all(len(curve) == STEPS for curve in got)
    assert all(isinstance(v, float) and math.isfinite(v) for curve in got for v in curve), got
    assert got[0][-1] < got[0][0] and got[1][-1] < got[1][0], got  # it learnt
    assert bg.outputs(wait) == ""  # nothing left to wait for, nothing failed
    assert "pool stopped" in bg.outputs(stop, "stdout")
    assert bg.left_after_cell[stop] == [], bg.left_after_cell[stop]  # %ddp stop ended every rank

    # the same notebook with the training cell blocking (its plot file there already: it never waits)
    (tmp_path / "blocking-plotted").touch()
    blocking = Run(cells(tmp_path / "blocking-plotted", bg=False), tmp_path)
    blocking.execute()
    assert "background" not in blocking.outputs(sent) + blocking.outputs(read)
    assert losses_of(blocking, read) == got  # the same numbers, to the bit


@pytest.mark.parametrize("then", ["wait", "read"])
def test_a_background_failure_fails_the_headless_run(runs_dir, tmp_path, then):
    """Rank 1 raises 2 s after the plot cell ran (so the failure is in no cell's way before): ``%ddp wait``
    raises it, as does a cell that reads the name it would have brought back; nbclient stops the run there."""
    run = Run(cells(tmp_path / "plotted", bg=True, fail=True, read=then == "read"), tmp_path)
    with pytest.raises(CellExecutionError) as failed:
        run.execute()
    text = str(failed.value)
    assert "BackgroundFailed" in text and "background cell [3] failed" in text, text
    assert "bad batch on rank 1" in text, text
    if then == "read":
        assert "losses did not arrive; the cell did not run" in text, text
        assert "print('steps'" in text  # nbclient names the cell that failed
    else:
        assert "%ddp wait" in text
    assert run.seen, "no rank process was ever seen"
    last = max(run.left_after_cell)
    assert run.nb.cells[last].source in ("%ddp wait", READ)  # nothing after it ran
