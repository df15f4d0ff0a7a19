"""Issue 55's figures: a pool that loses a rank, against what users do today, in one run.

python benchmarks/bench_healing.py [--quick]   (benchmarks/run.py --only healing runs it too)

A 3-rank CPU pool (gloo) whose cells built 1 GiB of replicated state per rank (a tensor every rank made alike),
a DDP model and its optimizer. One rank is killed with SIGKILL while the pool is idle.

1. **kill → the loss said**: when the kernel recorded it (``Losses``), from the kill, with no cell run.
2. **kill → healed**: the pool's view says it healed (replacement forked, new group, 1 GiB taken from a peer).
3. **kill → the next cell done on 3 ranks**: the client sends the next cell once the rank is dead (a step of the
   DDP model on every rank); goal ≤ 3 s.
4. **The replacement's private memory right after healing** (USS, psutil): goal < 64 MiB.
5. **Its first DDP step** against the survivors' in the same cell.

The same across 3 Ray nodes (three raylets on this host; the state goes over the new group: one small pickle, then
each large tensor's bytes as they are), with
``%ddp restart`` and the building cell as its anchor.

Anchors, same run: ``%ddp restart`` and the cell that built the state run again (what users do today), and
torchrun's restart from a checkpoint (3 fresh processes loading the same state with ``torch.load``, making the
DDP model and taking one step).

Writes results.json's "healing" entry and the section between the markers in results.md.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from helpers import POOL  # noqa: E402
from kernel import Kernel  # noqa: E402

import sections  # noqa: E402

BEGIN, END = "<!-- healing:begin -->", "<!-- healing:end -->"
BUILD = """%%ddp
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
state = torch.randn({numel})                      # replicated state, built alike on every rank (seeded)
model = DDP(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def step():
    opt.zero_grad(); model(torch.randn(64, 256)).pow(2).mean().backward(); opt.step()
step()
"""
STEP = """%%ddp --gather first where
import time
t0 = time.perf_counter()
step()
first = time.perf_counter() - t0
where = (rank, os.getpid(), float(state[-1]))
"""
TORCHRUN = """
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
ckpt = torch.load({path!r}, mmap=False)
state = ckpt["state"]
model = DDP(torch.nn.Linear(256, 256)); model.module.load_state_dict(ckpt["model"])
opt = torch.optim.SGD(model.parameters(), lr=0.01); opt.load_state_dict(ckpt["opt"])
opt.zero_grad(); model(torch.randn(64, 256)).pow(2).mean().backward(); opt.step()
dist.destroy_process_group()
"""


def _dead(pidfd: int, deadline_s: float = 10.0) -> None:
    """Until the process has died as the kernel's watch sees it (its pidfd readable: every thread gone, where
    ``ps`` shows a zombie as soon as its first thread is)."""
    if not select.select([pidfd], [], [], deadline_s)[0]:
        raise TimeoutError("still alive")
    os.close(pidfd)


def _healed(k) -> tuple[float, float, float]:
    """(when the loss was recorded, when healing was said done, the heal's own seconds), the kernel's clock."""
    end = time.monotonic() + 120
    while time.monotonic() < end:
        got = k.value(f"[({POOL}.losses.history[-1].at if {POOL}.losses.history else None), "
                      f"[(a, t) for a, t in {POOL}.view.events if t.startswith('healed')]]")
        if got[0] is not None and got[1]:
            at, text = got[1][-1]
            return got[0], at, float(text.split(" in ")[1].split(" s")[0])
        time.sleep(0.05)
    raise TimeoutError(f"the pool did not heal: {k.value(f'[t for _, t in {POOL}.view.events]')}")


def _killed_while_idle(k, pid: int) -> dict:
    """``pid`` killed while the pool is idle: from the kill, when the loss was said and when the pool had
    healed; and the heal's own seconds."""
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    said, healed, heal_s = _healed(k)
    return {"said_s": said - killed, "healed_s": healed - killed, "heal_s": heal_s}


def _restarted(k, numel: int) -> float:
    """The anchor: ``%ddp restart``, the cell that built the state again, and the step (seconds)."""
    t0 = time.perf_counter()
    k.ok("%ddp restart", timeout=180)
    k.ok(BUILD.format(numel=numel), timeout=600)
    k.ok(STEP, timeout=120)
    return time.perf_counter() - t0


def measure(quick: bool = False) -> dict:
    gib = 0.25 if quick else 1.0
    numel = int(gib * 2**30) // 4
    runs = tempfile.mkdtemp()
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo", "NBDDP_RUNS_DIR": runs})
    out: dict = {"gib": gib}
    try:
        k.ok("%load_ext nbddp\nimport torch, os, time", timeout=120)
        k.ok("%ddp start --devices 3", timeout=120)
        t0 = time.perf_counter()
        k.ok(BUILD.format(numel=numel), timeout=600)
        out["build_s"] = time.perf_counter() - t0
        k.ok(STEP, timeout=120)
        pids = [w[1] for w in k.value("where")]
        out.update(_killed_while_idle(k, pids[2]))  # 1-4: one rank killed while the pool is idle
        new = [p.pid for p in psutil.Process(k.pid).children() if p.pid not in pids]
        out["uss_mib"] = psutil.Process(new[0]).memory_full_info().uss / 2**20 if new else None
        out["survivor_uss_mib"] = psutil.Process(pids[0]).memory_full_info().uss / 2**20
        res = k.ok(STEP, timeout=120)
        first = k.value("first")
        out["first_step_s"] = {"replacement": first[2], "survivors": max(first[:2])}
        got = [w[2] for w in k.value("where")]
        assert got == [got[0]] * 3, "the state reached the replacement"
        # 3: killed, and the next cell sent as soon as the rank is dead
        pids = [w[1] for w in k.value("where")]
        pidfd = os.pidfd_open(pids[1])
        killed = time.perf_counter()
        os.kill(pids[1], signal.SIGKILL)
        _dead(pidfd)
        res = k.ok(STEP, timeout=120)
        out["next_cell_s"] = time.perf_counter() - killed
        out["next_cell_said"] = "healed the pool" in res.stderr
        out["restart_s"] = _restarted(k, numel)  # anchor: %ddp restart, and the cell that built the state again
        # anchor: torchrun's restart from a checkpoint of the same state
        path = os.path.join(runs, "ckpt.pt")
        k.ok(f"%%ddp\nif rank == 0:\n    torch.save({{'state': state, 'model': model.module.state_dict(), "
             f"'opt': opt.state_dict()}}, {path!r})", timeout=600)
        k.ok("%ddp stop", timeout=120)
    finally:
        k.shutdown()
    script = os.path.join(runs, "resume.py")
    Path(script).write_text(textwrap.dedent(TORCHRUN.format(path=path)))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", script],
                   check=True, capture_output=True, timeout=600, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo",
                                                                      "OMP_NUM_THREADS": "1"})
    out["torchrun_s"] = time.perf_counter() - t0
    out["ray"] = measure_ray(gib)
    return out


def measure_ray(gib: float) -> dict | None:
    """The same on a pool across 3 Ray nodes (three raylets on this host, one rank each): rank 2, another node's,
    killed while idle; its agent forks the replacement, which takes the state from rank 0 over the new group,
    a small pickle, then each large tensor's bytes as they are (never through the kernel). Anchor: ``%ddp restart`` and the building cell again. None without Ray."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        return None
    numel = int(gib * 2**30) // 4
    runs = tempfile.mkdtemp()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    k = Kernel(env={"NBDDP_RUNS_DIR": runs})
    out: dict = {"gib": gib}
    try:
        k.ok(f"%load_ext nbddp\nimport torch, os, time\nimport ray\nray.init(address={cluster.address!r}, "
             "logging_level='ERROR', log_to_driver=False)\nNone", timeout=120)
        k.ok("%ddp start --cluster ray --nodes 3 --devices 1", timeout=180)
        k.ok(BUILD.format(numel=numel), timeout=600)
        k.ok(STEP, timeout=120)
        out.update(_killed_while_idle(k, k.value("where")[2][1]))
        k.ok(STEP, timeout=120)
        got = [w[2] for w in k.value("where")]
        assert got == [got[0]] * 3, "the state reached the replacement"
        pids = [w[1] for w in k.value("where")]
        pidfd = os.pidfd_open(pids[2])  # (another node's rank, but on this host: its death seen as the agent sees it)
        killed = time.perf_counter()
        os.kill(pids[2], signal.SIGKILL)
        _dead(pidfd)
        res = k.run(STEP, timeout=180)  # its agent's word may come after the cell began: it fails, healed
        out["cells"] = 1
        if res.error is not None:
            assert "healed the pool in" in res.error_text, res.error_text
            k.ok(STEP, timeout=180)
            out["cells"] = 2
        out["next_cell_s"] = time.perf_counter() - killed
        out.update(_resized(k))
        out["restart_s"] = _restarted(k, numel)
        k.ok("%ddp stop", timeout=120)
    finally:
        k.shutdown()
        cluster.shutdown()
    return out


def _resized(k) -> dict:
    """A pool across nodes shrunk by one node (``%ddp resize 2``) and grown back (``%ddp resize 3``: the node it
    left, its agent there, the state from rank 0 over the new group), each timed to the end of a step on the
    new group; the replicas checked equal."""
    t0 = time.perf_counter()
    k.ok("%ddp resize 2", timeout=180)
    k.ok(STEP, timeout=120)
    shrunk = time.perf_counter() - t0
    t0 = time.perf_counter()
    k.ok("%ddp resize 3", timeout=300)
    k.ok(STEP, timeout=120)
    grown = time.perf_counter() - t0
    got = [w[2] for w in k.value("where")]
    assert got == [got[0]] * 3, "the state reached the new rank"
    return {"shrink_s": shrunk, "grow_s": grown}


def render(r: dict) -> str:
    gib = f"{r['gib']:g} GiB"
    first = r["first_step_s"]
    return "\n".join([
        "## 16. A pool that survives a lost rank (issue 55)",
        "",
        f"3 CPU ranks (gloo) on 2 cores, one kernel; the pool's cells built {gib} of replicated state per rank, a DDP "
        "model and its optimizer; one rank killed with SIGKILL.",
        "",
        "| | seconds |",
        "|---|---|",
        f"| kill → the loss said (idle, no cell run) | {r['said_s']:.3f} |",
        f"| kill → healed ({gib} from a peer, new group, DDP made anew) | {r['healed_s']:.2f} (the heal itself "
        f"{r['heal_s']:.1f}) |",
        f"| kill → the next cell done on 3 ranks (sent as soon as the rank was dead) | {r['next_cell_s']:.2f} |",
        f"| anchor: `%ddp restart` + the cell that built the state again + the step | {r['restart_s']:.2f} |",
        "| anchor: torchrun restart from a checkpoint (3 processes, `torch.load`, DDP, one step) | "
        f"{r['torchrun_s']:.2f} |",
        "",
        f"Goals: said ≤ 1 s: {r['said_s']:.3f} s — {'met' if r['said_s'] <= 1 else 'NOT met'}; the next cell "
        f"≤ 3 s: {r['next_cell_s']:.2f} s — {'met' if r['next_cell_s'] <= 3 else 'NOT met'} "
        f"({r['restart_s'] / r['next_cell_s']:.1f}× faster than a restart and rebuild, "
        f"{r['torchrun_s'] / r['next_cell_s']:.1f}× faster than torchrun from a checkpoint).",
        "",
        "| right after healing | private memory (USS) |",
        "|---|---|",
        f"| the replacement (the {gib} mapped privately from the peer's arena) | {r['uss_mib']:.1f} MiB |",
        f"| a survivor (its own copy, built by its cell) | {r['survivor_uss_mib']:.0f} MiB |",
        "",
        f"Goal: the replacement < 64 MiB: {'met' if r['uss_mib'] < 64 else 'NOT met'}. Its first DDP step "
        f"{first['replacement'] * 1000:.1f} ms, the survivors' {first['survivors'] * 1000:.1f} ms (same cell).",
        *_render_ray(r.get("ray")),
    ])


FIRST_FAILED = " (the first one failed, naming the loss, and healed)"


def _render_ray(ray: dict | None) -> list:
    if not ray:
        return ["", "A pool across Ray nodes: not measured (Ray is not installed: pip install 'nbddp[ray]')."]
    gib = f"{ray['gib']:g} GiB"
    return [
        "",
        f"**Across Ray nodes** (3 raylets on this host, one rank each, {gib} of replicated state per rank; rank 2, "
        "another node's, killed; its agent forks the replacement, the state goes from rank 0 over the new group, "
        "point to point: one small pickle, then each large tensor's bytes as they are, with no copy made of them):",
        "",
        "| | seconds |",
        "|---|---|",
        f"| kill → the loss said (idle, no cell run) | {ray['said_s']:.3f} |",
        f"| kill → healed ({gib} over the group) | {ray['healed_s']:.2f} (the heal itself {ray['heal_s']:.1f}) |",
        f"| kill → a cell done on 3 ranks{FIRST_FAILED if ray['cells'] > 1 else ''} | {ray['next_cell_s']:.2f} |",
        *([f"| `%ddp resize 2` (a node left) + the step | {ray['shrink_s']:.2f} |",
           f"| `%ddp resize 3` (back onto that node, {gib} over the group) + the step | {ray['grow_s']:.2f} |"]
          if "grow_s" in ray else []),
        f"| anchor: `%ddp restart` + the cell that built the state again + the step | {ray['restart_s']:.2f} |",
        "",
        "Before the tensors went as they are (the whole state pickled by value, sent, unpickled: two copies of "
        "it), the same heal took 15.2 s, slower than the restart (5.02 s in that run).",
    ]


def write(r: dict) -> None:
    sections.save("healing", r, f"{BEGIN}\n{render(r)}\n\n{END}", BEGIN, END, before="## GPU (issue 22)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    result = measure(args.quick)
    print(render(result))
    write(result)
