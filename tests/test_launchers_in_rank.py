"""Launchers started inside a rank, and processes a rank starts dying with the kernel (issue 10, point 3).

Real kernel, real Lightning / Accelerate / torch.multiprocessing; every wait has a deadline."""
import os
import queue
import re
import signal
import time

import psutil
import pytest

from kernel import Kernel

pytestmark = pytest.mark.timeout(240)

# The PyTorch DDP tutorial's basic example (pytorch/tutorials intermediate_source/ddp_tutorial.rst), CPU/gloo
DDP_TUTORIAL = '''
import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")

def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn,
             args=(world_size,),
             nprocs=world_size,
             join=True)
'''


def test_mp_spawn_of_the_ddp_tutorial_runs_on_the_cells_ranks(clean_kernel):
    res = clean_kernel.ok("%%ddp --devices 2\n" + DDP_TUTORIAL + "\nrun_demo(demo_basic, 2)\n", timeout=120)
    for r in (0, 1):
        assert f"[rank{r}]:Finished running basic DDP example on rank {r}." in res.stdout
    assert res.stdout.count("Running basic DDP example") == 2  # not world_size² processes
    assert "runs demo_basic(rank, ...) on this cell's 2 ranks" in res.stderr


def test_mp_spawn_with_another_count_says_what_to_write(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2\n" + DDP_TUTORIAL + "\nrun_demo(demo_basic, 4)\n", timeout=60)
    text = res.error_text
    assert "LaunchInRankError" in text and "nprocs=4" in text
    assert "demo_basic(rank, *args) directly" in text and "%%ddp --devices 4" in text
    assert res.seconds < 30


def test_a_launcher_a_library_bound_before_the_cell_runs_on_the_cells_ranks(clean_kernel):
    # a library imported in the notebook that did `from torch.multiprocessing import spawn`: the kernel
    # finds the binding before the fork (inherit.found), the rank patches it without walking sys.modules
    clean_kernel.ok("import sys, types, torch.multiprocessing\n"
                    "lib = types.ModuleType('accelerate_shim'); lib.spawn = torch.multiprocessing.spawn\n"
                    "sys.modules['accelerate_shim'] = lib\n"
                    "def hello(rank):\n    print('hello from', rank)\n")
    res = clean_kernel.ok("%%ddp --devices 2\nimport accelerate_shim\naccelerate_shim.spawn(hello, nprocs=2)\n",
                          timeout=120)
    for r in (0, 1):
        assert f"[rank{r}]:hello from {r}" in res.stdout, res.stdout
    assert "runs hello(rank, ...) on this cell's 2 ranks" in res.stderr


@pytest.mark.unit
def test_what_a_rank_patches_is_found_before_the_fork_and_again_after_an_import():
    import sys
    import types

    import torch.multiprocessing

    from nbddp.rank import inherit

    lib = types.ModuleType("accelerate_before")
    lib.start_processes = torch.multiprocessing.start_processes
    sys.modules[lib.__name__] = lib
    try:
        inherit.before_fork()
        assert ("accelerate_before", "start_processes") in inherit.found("launchers")
        late = types.ModuleType("accelerate_after")  # imported after the scan: found by a walk of its own
        late.spawn = torch.multiprocessing.spawn
        sys.modules[late.__name__] = late
        assert ("accelerate_after", "spawn") in inherit.found("launchers")
    finally:
        sys.modules.pop("accelerate_before", None)
        sys.modules.pop("accelerate_after", None)


def test_lightning_ddp_notebook_fails_within_seconds_naming_strategy_ddp(clean_kernel):
    res = clean_kernel.run(
        "%%ddp --devices 2 --timeout 100\n"
        "import pytorch_lightning as pl\n"
        "from pytorch_lightning.demos.boring_classes import BoringModel\n"
        "trainer = pl.Trainer(strategy='ddp_notebook', accelerator='cpu', devices=2, max_epochs=1,\n"
        "                     limit_train_batches=2, limit_val_batches=0, logger=False,\n"
        "                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
        "trainer.fit(BoringModel())\n", timeout=120)
    text = res.error_text
    assert 'Trainer(strategy="ddp", devices=2)' in text, text
    assert "--timeout" not in text.splitlines()[0] and res.seconds < 60


def test_accelerate_notebook_launcher_and_nested_torchrun_are_refused(clean_kernel):
    res = clean_kernel.run(
        "%%ddp --devices 2\n"
        "from accelerate import notebook_launcher\n"
        "def training_function():\n    print('trained')\n"
        "notebook_launcher(training_function, num_processes=2)\n", timeout=120)
    assert "notebook_launcher" in res.error_text and "training_function(*args)" in res.error_text, res.error_text
    res = clean_kernel.run("%%ddp --devices 2\n!torchrun --standalone --nproc-per-node 2 train.py\n", timeout=60)
    assert "would start a whole torchrun job" in res.error_text and "outside %%ddp" in res.error_text
    res = clean_kernel.run("%%ddp --devices 2\nimport subprocess\n"
                           "subprocess.run(['python', '-m', 'torch.distributed.run', 'x.py'])\n", timeout=60)
    assert "would start a whole torchrun job" in res.error_text


def test_a_timeout_report_shows_the_processes_a_rank_started(clean_kernel):
    res = clean_kernel.run(
        "%%ddp --devices 2 --timeout 4\n"
        "import multiprocessing as mp, time\n"
        "def worker_waits_here():\n    time.sleep(60)\n"
        "p = mp.get_context('fork').Process(target=worker_waits_here); p.start()\n"
        "p.join()\n", timeout=90)
    text = res.error_text
    assert "--timeout 4s expired" in text
    assert "worker_waits_here" in text, text  # the rank's own child, not only the rank


def _iopub_until(k: Kernel, msg_id: str, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            msg = k.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            text += msg["content"]["text"]
            m = re.search(pattern, text)
            if m:
                return m
    raise TimeoutError(f"never saw {pattern!r}; got {text!r}")


def test_kill_9_of_the_kernel_takes_every_process_a_rank_started(runs_dir):
    pids = []
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        try:
            k.ok("%load_ext nbddp\nimport torch")
            msg_id = k.execute(
                "%%ddp --devices 2\n"
                "import os, subprocess, multiprocessing as mp, time\n"
                "sub = subprocess.Popen(['sleep', '300'])\n"
                "forked = mp.get_context('fork').Process(target=time.sleep, args=(300,)); forked.start()\n"
                "print(f'PIDS {os.getpid()} {sub.pid} {forked.pid}', flush=True)\n"
                "time.sleep(300)\n")
            found = set()
            deadline = time.monotonic() + 60
            while len(found) < 2 and time.monotonic() < deadline:
                m = _iopub_until(k, msg_id, r"\[rank(\d)\]:PIDS (\d+) (\d+) (\d+)\n", deadline - time.monotonic())
                found.add(m.group(0))
                pids += [int(m.group(i)) for i in (2, 3, 4)]
                if len(found) < 2:  # the other rank's line may already be in the same text
                    rest = re.findall(r"\[rank(\d)\]:PIDS (\d+) (\d+) (\d+)\n", m.string)
                    for line in rest:
                        tag = f"[rank{line[0]}]:PIDS {line[1]} {line[2]} {line[3]}\n"
                        if tag not in found:
                            found.add(tag)
                            pids += [int(x) for x in line[1:]]
            assert len(set(pids)) == 6, pids
            procs = [psutil.Process(p) for p in set(pids)]
            os.kill(k.pid, signal.SIGKILL)
            gone, alive = psutil.wait_procs(procs, timeout=15)
            assert not alive, f"outlived the kernel: {[(p.pid, p.name()) for p in alive]}"
        finally:  # the rank's children, orphaned when the kernel was killed
            for p in set(pids):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
