"""Scripts that manage their own process group run unchanged in a cell (issue 10, point 1).

Real kernel, real forks, real torchrun; the tutorial script is pytorch/examples' own (tests/peers)."""
import json
import os
import sys
from pathlib import Path

import pytest

from kernel import said
from torchrun import torchrun

pytestmark = pytest.mark.timeout(300)
PEERS = Path(__file__).resolve().parent / "peers"
TORCHRUN = Path(sys.executable).parent / "torchrun"
EDITS = [  # what a user changes to run the GPU tutorial on CPU: cuda -> cpu, nccl -> gloo; nothing else
    ('    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n', ""),
    ('init_process_group(backend="nccl")', 'init_process_group(backend="gloo")'),
    ("self.model = model.to(self.gpu_id)", 'self.model = model.to("cpu")'),
    ("DDP(self.model, device_ids=[self.gpu_id])", "DDP(self.model)"),
    ("source = source.to(self.gpu_id)", 'source = source.to("cpu")'),
    ("targets = targets.to(self.gpu_id)", 'targets = targets.to("cpu")'),
]


def _cpu_tutorial(tmp_path: Path) -> Path:
    text = (PEERS / "multigpu_torchrun.py").read_text()
    for old, new in EDITS:
        assert old in text, f"pytorch/examples changed: {old!r} is gone"
        text = text.replace(old, new)
    (tmp_path / "datautils.py").write_text((PEERS / "datautils.py").read_text())
    script = tmp_path / "multigpu_torchrun.py"
    script.write_text(text)
    return script


def _tutorial_lines(text: str) -> list[str]:
    """The tutorial's reports, wherever they are: torchrun's two processes share one stdout pipe, so
    their lines can run into each other ('…Steps: 32[GPU1] Epoch 0…'), which a line split would miss."""
    import re

    text = re.sub(r"\[rank[\d,\-–]+\]:", "", text)
    return sorted(re.findall(r"\[GPU\d\] Epoch \d+ \| Batchsize: \d+ \| Steps: \d+|"
                             r"Epoch \d+ \| Training snapshot saved at snapshot\.pt", text))


def test_pytorch_examples_torchrun_tutorial_runs_unchanged_in_a_cell(clean_kernel, tmp_path):
    script = _cpu_tutorial(tmp_path)
    (tmp_path / "torchrun").mkdir()
    run = torchrun(script, 2, 1, timeout=240, cwd=tmp_path / "torchrun")
    assert run.returncode == 0, run.stderr[-3000:]
    (tmp_path / "cell").mkdir()
    res = clean_kernel.ok(
        "%%ddp --devices 2\n"
        f"import os, sys\nos.chdir({str(tmp_path / 'cell')!r})\nsys.path.insert(0, {str(tmp_path)!r})\n"
        "sys.argv = ['multigpu_torchrun.py', '2', '1']\n"
        + script.read_text()  # pasted as is: its own init_process_group, and destroy_process_group at the end
        + "\nimport torch.distributed as dist\nprint('group after the script:', dist.is_initialized())\n",
        timeout=180,
    )
    assert _tutorial_lines(res.stdout) == _tutorial_lines(run.stdout), (res.stdout, run.stdout)
    assert "[GPU1] Epoch 1 | Batchsize: 32 | Steps: 32" in _tutorial_lines(res.stdout)
    assert said(res.stdout, 0, "group after the script: False"), res.stdout
    assert (tmp_path / "cell" / "snapshot.pt").exists()


def test_destroy_then_reinit_and_out_values_survive(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2 --out first second\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='env://', rank=int(os.environ['RANK']),\n"
        "                        world_size=int(os.environ['WORLD_SIZE']))\n"
        "t = torch.tensor([rank + 1.0]); dist.all_reduce(t); first = t.item()\n"
        "dist.destroy_process_group()\n"
        "print('after destroy', dist.is_initialized())\n"
        "try:\n    dist.get_rank()\nexcept ValueError as e:\n    print('no group:', 'not been initialized' in str(e))\n"
        "dist.init_process_group()\n"
        "t = torch.tensor([10.0 * (rank + 1)]); dist.all_reduce(t); second = t.item()\n"
        "dist.destroy_process_group()\n"
        "rank\n",
        timeout=120,
    )
    for r in (0, 1):
        assert said(res.stdout, r, "after destroy False") and said(res.stdout, r, "no group: True"), res.stdout
    assert clean_kernel.value("(first, second)") == (3.0, 30.0)


def test_a_second_init_fails_as_under_torchrun_and_a_different_group_says_what_to_write(clean_kernel):
    twice = clean_kernel.run("%%ddp --devices 2\nimport torch.distributed as dist\n"
                             "dist.init_process_group()\ndist.init_process_group()\n", timeout=120)
    assert "initialize the default process group twice" in twice.error_text
    other = clean_kernel.run("%%ddp --devices 2\nimport torch.distributed as dist\n"
                             "dist.init_process_group('gloo', world_size=4, rank=rank)\n", timeout=120)
    text = other.error_text
    assert "world_size=4, but the cell runs 2 ranks" in text and "%%ddp --devices 4" in text
    assert "line 3" in text  # the user's line, not nbddp's


ENV_DUMP = "import json, os\nprint(json.dumps(sorted(os.environ)))\n"


def test_the_torchrun_environment_and_record_match_torchrun(clean_kernel, tmp_path, runs_dir):
    dump = tmp_path / "dump.py"
    dump.write_text("import os\nif os.environ['RANK'] == '0':\n    " + ENV_DUMP.replace("\n", "\n    "))
    base = set(os.environ)
    run = torchrun(dump, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    torchrun_keys = set(json.loads(run.stdout.strip().splitlines()[-1])) - base - {"COLUMNS", "LINES"}  # terminal size
    res = clean_kernel.ok("%%ddp --devices 2 --ranks-output 0 --no-prefix\n" + ENV_DUMP, timeout=120)
    cell_keys = set(json.loads(res.stdout.strip()))
    assert torchrun_keys - cell_keys == set(), "keys torchrun sets that a %%ddp rank lacks"

    failed = clean_kernel.run(
        "%%ddp --devices 2\nfrom torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\ndef main():\n    raise ValueError(f'recorded on {rank}')\nmain()\n", timeout=120)
    assert "ValueError: recorded on" in failed.error_text
    run = max((f.parent for f in runs_dir.glob("*/rank*.error.json")), default=None)  # this cell's (named by time)
    assert run, "@record wrote no error file"
    # the rank that failed first wrote its whole record; its peer may be stopped by nbddp before it ends its own
    records = [json.loads(t) for f in run.glob("rank*.error.json") if (t := f.read_text())]
    assert any("recorded on" in r["message"]["message"] for r in records), records


PASTED_SCRIPT = """\
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group

def main():
    init_process_group(backend="gloo")
    ds = TensorDataset(torch.randn(512, 20), torch.randn(512, 1))
    dl = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds))
    model = DDP(torch.nn.Linear(20, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for epoch in range(2):
        dl.sampler.set_epoch(epoch)
        for x, y in dl:
            opt.zero_grad(); F.mse_loss(model(x), y).backward(); opt.step()
    destroy_process_group()
    return epoch

tr = main()   # the DDP model goes here, after destroy_process_group: torch froze here 1 run in 2-8
print("done", tr)
"""


def test_a_pasted_script_that_lets_its_ddp_model_go_after_destroy_never_hangs(clean_kernel):
    """Issue 21 point 1: in a kernel that trained a model itself, the script above hung 1 run in 2-8
    (ProcessGroupGloo's destructor joining a worker that waits for the GIL). 20 one-shot runs and 10 in
    a pool (where destroyed groups are let go before the next cell) must each end in seconds."""
    clean_kernel.ok("m = torch.nn.Linear(200, 10); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                    "for _ in range(50):\n    o.zero_grad(); m(torch.randn(256, 200)).sum().backward(); o.step()\n")
    for i in range(20):
        res = clean_kernel.ok("%%ddp --devices 2\n" + PASTED_SCRIPT, timeout=30)
        assert said(res.stdout, 0, "done 1") and said(res.stdout, 1, "done 1"), (i, res)
    clean_kernel.ok("%ddp start --devices 2", timeout=60)
    try:
        for i in range(10):
            res = clean_kernel.ok("%%ddp\n" + PASTED_SCRIPT, timeout=30)
            assert said(res.stdout, 0, "done 1") and said(res.stdout, 1, "done 1"), (i, res)
        held = clean_kernel.ok("%%ddp\nimport gc; from nbddp.rank import usergroup\n"
                               "print('kept', len(usergroup._state['kept']))\n", timeout=30)
        assert said(held.stdout, 0, "kept 0"), held.stdout  # let go before this command: no group piles up
    finally:
        clean_kernel.ok("%ddp stop", timeout=60)


def test_a_rank_whose_stack_stops_moving_after_its_peers_finished_is_shown_live(clean_kernel):
    """Without --timeout, a rank still in the cell STILL_S after its peers finished, at the same place as
    at the last ask, is named in the cell while it runs; the interrupt then stops it."""
    clean_kernel.ok("import nbddp.timeline as _timeline; _timeline.STILL_S = 3.0")
    seen = []

    def watch(kind, content):
        if kind == "stream" and "is still at" in content.get("text", "") and not seen:
            seen.append(content["text"])
            clean_kernel.interrupt()

    try:
        res = clean_kernel.collect(clean_kernel.execute(
            "%%ddp --devices 2\nimport time\nif rank == 0:\n    time.sleep(60)\nprint('finished')\n"),
            timeout=45, on_message=watch)
    finally:
        clean_kernel.ok("_timeline.STILL_S = 30.0")
    assert seen, res
    line = seen[0]
    assert "nbddp: rank 0 is still at Cell In[" in line and "line 4, in <module>: time.sleep(60)" in line, line
    assert "after rank 1 finished" in line and "Interrupt to stop it" in line, line
    assert "KeyboardInterrupt" in res.error_text and "rank(s) 0 ran the cell" in res.error_text, res.error_text


@pytest.mark.unit
def test_a_groups_sockets_are_known_by_inode_so_a_reused_number_is_new_and_never_shut_as_old():
    """The Ray flake (1 run in 4 of benchmarks §16): gloo closed the old group's sockets while the next group
    connected, the new group's connections took the same descriptor numbers, ``sockets() - before`` left them
    out, and the next Regroup never shut the connection a survivor was stuck on."""
    import socket

    from nbddp.rank import usergroup

    old_a, old_b = socket.socketpair()
    before = usergroup.sockets()
    old = {pair for pair in before if pair[0] == old_a.fileno()}
    number = old_a.fileno()
    old_a.close()
    new_a, new_b = socket.socketpair()
    try:
        assert number in (new_a.fileno(), new_b.fileno()), "Linux hands out the lowest free number"
        reused = new_a if new_a.fileno() == number else new_b
        assert any(fd == number for fd, _ in usergroup.sockets() - before), "the reused number counts as new"
        usergroup._shut(old)  # the old group's socket, long closed: the new one on its number is left alone
        peer = new_b if reused is new_a else new_a
        reused.sendall(b"x")
        assert peer.recv(1) == b"x"
    finally:
        for s in (old_b, new_a, new_b):
            s.close()
