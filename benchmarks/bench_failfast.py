"""A rank fails inside a training step while its peers wait for it in DDP's all_reduce: from the failure to the
cell's end (the pool and its state kept), against the same cell as nbddp ran it before, and torchrun.

python benchmarks/bench_failfast.py [--quick]

A 3-rank CPU pool (gloo), a DDP model; the cell steps it in a loop, and at the third step rank 1 fails:

1. **an exception on rank 1** (a bad batch): ranks 0 and 2 wait in the gradient all_reduce, where no interrupt
   reaches them. nbddp sees them blocked (kernel/cells/grace.py: asleep on a futex, running nothing), interrupts
   them, sees them still blocked, and frees them by a fresh process group (the DDP model made anew on it).
   "Whole graces": the same with the ranks looked at only once (``timeline.POLL_S`` set to infinity in the same
   kernel, the same run), as where /proc cannot tell: ``PEER_GRACE_S`` before the interrupt, ``STUCK_S`` after
   it (``HEALTH_S`` across Ray nodes), as nbddp did until this change.
2. **rank 1 killed** (SIGKILL, the out-of-memory killer's): the loss is known from its pidfd, the survivors' step
   fails as the peer's sockets close, a replacement heals the pool.

3. **across 3 Ray nodes** (three raylets on this host, one rank each): an exception on rank 1, the others' agents
   (or the kernel, for its own node's rank) looking at them; and the same with the whole graces.

Each from the moment rank 1 failed (its own clock, printed just before) to the client's reply; median of
``--runs``. Anchor: torchrun running the same loop as a script (3 processes), rank 1 raising at the same step:
from the raise to torchrun's exit (every worker torn down; nothing kept).

Writes results.json's "failfast" entry and the section between the markers in results.md.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from kernel import Kernel  # noqa: E402

import sections  # noqa: E402

BEGIN, END = "<!-- failfast:begin -->", "<!-- failfast:end -->"
BUILD = """%%ddp
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def step():
    opt.zero_grad(); model(torch.randn(64, 256)).pow(2).mean().backward(); opt.step()
step()
"""
FAIL = """%%ddp
import os, signal, time
for i in range(100):
    if rank == 1 and i == 3:
        print("FAILED_AT", time.time(), flush=True)
        {how}
    step()
"""
HOW = {"raise": "raise ValueError('a bad batch')", "kill": "os.kill(os.getpid(), signal.SIGKILL)"}
TORCHRUN = """
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(100):
    if rank == 1 and i == 3:
        print("FAILED_AT", time.time(), flush=True)
        raise ValueError("a bad batch")
    opt.zero_grad(); model(torch.randn(64, 256)).pow(2).mean().backward(); opt.step()
"""


def _failed_at(text: str) -> float:
    return float(re.search(r"FAILED_AT ([\d.]+)", text).group(1))


def _pool_cell(k, how: str) -> float:
    """Seconds from rank 1's failure to the client's reply; the pool checked whole after it."""
    res = k.run(FAIL.format(how=HOW[how]), timeout=120)
    end = time.time()
    assert res.error, "the cell failed"
    took = end - _failed_at(res.stdout)
    k.ok("%%ddp\nstep()\n", timeout=120)  # (healed, or the group made anew: the next step runs on 3 ranks)
    return took


def _torchrun(script: str) -> float:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    end = time.time()
    assert proc.returncode != 0, "torchrun reported the failure"
    return end - _failed_at(proc.stdout)


def measure(runs: int = 5) -> dict:
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo", "NBDDP_RUNS_DIR": tempfile.mkdtemp()})
    out: dict = {"runs": runs}
    try:
        k.ok("%load_ext nbddp\nimport torch", timeout=120)
        k.ok("%ddp start --devices 3", timeout=120)
        k.ok(BUILD, timeout=120)
        series = _raised(k, runs, kill=True)
        k.ok("%ddp stop", timeout=120)
    finally:
        k.shutdown()
    script = os.path.join(tempfile.mkdtemp(), "fails.py")
    Path(script).write_text(TORCHRUN)
    series["torchrun"] = [_torchrun(script) for _ in range(runs)]
    series.update(measure_ray(runs))
    out.update({name: statistics.median(xs) for name, xs in series.items()})
    out["all"] = series
    return out


def _raised(k, runs: int, kill: bool = False, prefix: str = "") -> dict:
    """``runs`` of rank 1 raising, with the looks and with the whole graces (and killed), interleaved: a busy
    moment of the machine falls on each alike."""
    k.ok("from nbddp import timeline\n_poll = timeline.POLL_S")
    series: dict = {f"{prefix}raise": [], f"{prefix}raise_whole": [], **({"kill": []} if kill else {})}
    for _ in range(runs):
        series[f"{prefix}raise"].append(_pool_cell(k, "raise"))
        k.ok("timeline.POLL_S = float('inf')")  # looked at once: the whole graces, as before this change
        series[f"{prefix}raise_whole"].append(_pool_cell(k, "raise"))
        k.ok("timeline.POLL_S = _poll")
        if kill:
            series["kill"].append(_pool_cell(k, "kill"))
    return series


def measure_ray(runs: int) -> dict:
    """Rank 1 raising on a pool across 3 Ray nodes (three raylets on this host, one rank each); {} without Ray."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        return {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo", "NBDDP_RUNS_DIR": tempfile.mkdtemp()})
    try:
        k.ok(f"%load_ext nbddp\nimport torch\nimport ray\nray.init(address={cluster.address!r}, "
             "logging_level='ERROR', log_to_driver=False)\nNone", timeout=120)
        k.ok("%ddp start --cluster ray --nodes 3 --devices 1", timeout=180)
        k.ok(BUILD, timeout=120)
        series = _raised(k, runs, prefix="ray_")
        k.ok("%ddp stop", timeout=120)
    finally:
        k.shutdown()
        cluster.shutdown()
    return series


def render(r: dict) -> str:
    return "\n".join([
        "## 17. A rank fails inside a training step: from the failure to the cell's end",
        "",
        "3 CPU ranks (gloo) on 2 cores, a DDP model stepped in a loop; at the third step rank 1 fails while ranks 0 "
        "and 2 wait for it in DDP's gradient all_reduce. From rank 1's failure (its clock) to the client's reply, "
        f"median of {r['runs']} interleaved runs; after each, the next step runs on 3 ranks.",
        "",
        "| | seconds | the pool and its state |",
        "|---|---|---|",
        f"| an exception on rank 1 | {r['raise']:.2f} | kept; the group made anew, DDP made anew on it |",
        f"| the same with the whole graces (as before this change; where /proc cannot tell) | {r['raise_whole']:.2f} "
        "| kept |",
        f"| rank 1 killed (SIGKILL) | {r['kill']:.2f} | kept; a replacement healed from a peer |",
        *([f"| across 3 Ray nodes (3 raylets on this host, one rank each): an exception on rank 1 | {r['ray_raise']:.2f} "
           "| kept; the group and DDP made anew |",
           f"| the same with the whole graces (1 s, then 3 s across nodes) | {r['ray_raise_whole']:.2f} | kept |"]
          if "ray_raise" in r else ["| across Ray nodes | not measured (Ray is not installed) | |"]),
        f"| anchor: torchrun, the same loop as a script, rank 1 raising | {r['torchrun']:.2f} | every worker torn "
        "down |",
        "",
        f"An exception in a collective now ends the cell {r['raise_whole'] / r['raise']:.1f}× sooner than with the "
        f"whole graces ({r['raise_whole'] - r['raise']:.1f} s less), and {r['torchrun'] / r['raise']:.1f}× sooner than "
        "torchrun ends its job, which keeps nothing (its anchor for going on is a restart from a checkpoint: section "
        "16). The graces (`PEER_GRACE_S`, 1 s: the others may fail on their own first, and say so; `STUCK_S`, 1 s: an "
        "interrupted rank in Python answers well within it) now end at the first look, every 0.1 s, that finds every "
        "rank still in the cell blocked since the look before (asleep on a futex, neither it nor its threads nor its "
        "children running; after the interrupt, only ranks whose handler never ran: no `Heard`); a rank on another "
        "node is looked at by its agent"
        + (f" (across Ray nodes the cell ends {r['ray_raise_whole'] / r['ray_raise']:.1f}× sooner than with the whole "
           "graces)." if "ray_raise" in r else "."),
    ])


def write(r: dict) -> None:
    sections.save("failfast", r, f"{BEGIN}\n{render(r)}\n\n{END}", BEGIN, END, before="## GPU (issue 22)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    result = measure(runs=2 if args.quick else 5)
    print(render(result))
    write(result)
