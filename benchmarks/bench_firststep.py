"""Issue 34's figures: a real first step and real data, against the peers and torchrun, in one run.

python benchmarks/bench_firststep.py [--quick]   (benchmarks/run.py runs it too)

1. **First step.** Time from a cell's start to the end of its ranks' first ``DDP(Linear) + AdamW + backward +
   step`` (the slower rank), then steps/s over the next 200 steps, 2 CPU ranks, gloo. Each launcher runs in a
   kernel of its own (a kernel another launcher warmed would flatter it): nbddp one-shot (right after
   ``%load_ext``, when the fork waits for the warming thread, then a later cell), a pool's first cell,
   nbddp with ``NBDDP_WARM=0`` (what it was before), Lightning Fabric's ``ddp_notebook``, Accelerate's
   ``notebook_launcher``, and ``torchrun --standalone`` (from the command's start: interpreters and ``import
   torch`` are part of its cost). Also ``%load_ext nbddp``'s time after ``import torch`` and what warming
   costs the kernel (seconds, RSS).
2. **Real data.** Per-rank private memory (USS growth, smaps_rollup) reading its half of a list of dicts and
   of a DataFrame's string column (``StringDtype('python')``, pandas without Arrow storage), plain and
   ``nbddp.shared``, without and with 2 DataLoader workers per rank (each worker's growth), nbddp's one-shot
   cell beside Lightning's ``ddp_notebook`` (which forks the same way: a twin helps it as much).

Writes results.json's "firststep" entry and the section between the markers in results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from kernel import Kernel  # noqa: E402

import sections  # noqa: E402

BEGIN, END = "<!-- firststep:begin -->", "<!-- firststep:end -->"
STEPS = 200

# what every kernel defines: the step, timed inside the rank (wall clock, comparable across processes)
COMMON = r'''
import json, os, sys, time
def bench(name, value):
    print("BENCH " + json.dumps({"name": name, "value": value}), flush=True)
def first_step(t0, steps):
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    if not dist.is_initialized():  # torchrun's script, Accelerate: the launcher's environment
        dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    step()
    first = time.time() - t0
    t1 = time.perf_counter()
    for _ in range(steps):
        step()
    return first, steps / (time.perf_counter() - t1)
'''

def nbddp_kernel(steps: int, warm_on: bool) -> dict:
    env = {"NBDDP_RUNS_DIR": tempfile.mkdtemp(), "GLOO_SOCKET_IFNAME": "lo", **({} if warm_on else {"NBDDP_WARM": "0"})}
    k = Kernel(env=env)
    out = {}
    try:
        k.ok(COMMON + "\nimport torch, psutil\nrss0 = psutil.Process().memory_info().rss\nt = time.perf_counter()")
        k.ok("%load_ext nbddp")
        out.update(_bench(k.ok("bench('load_ext_s', time.perf_counter() - t)\nfrom nbddp.kernel.ranks import warm\n"
                               "T0 = time.time()").stdout))
        cell = f"%%ddp --devices 2 --gather r\nr = first_step(T0, {steps})\n"
        k.ok(cell, timeout=300)  # right after %load_ext: the fork waits for the warming thread
        out["right_after_load"] = max(x[0] for x in k.value("r"))
        res = k.ok("t = time.perf_counter()\nwarm.wait()\nbench('warm_wait_s', time.perf_counter() - t)\n"
                   "bench('warm_rss_mb', (psutil.Process().memory_info().rss - rss0) / 2**20)")
        out.update(_bench(res.stdout))
        firsts, rates = [], []
        for _ in range(3):
            k.ok("T0 = time.time()")
            k.ok(cell, timeout=300)
            r = k.value("r")
            firsts.append(max(x[0] for x in r))
            rates.append(min(x[1] for x in r))
        out["one_shot"], out["steps_per_s"] = sorted(firsts)[1], sorted(rates)[1]
        k.ok("%ddp start --devices 2", timeout=120)
        k.ok("T0 = time.time()")
        k.ok(cell.replace(" --devices 2", ""), timeout=300)
        out["pool_first_cell"] = max(x[0] for x in k.value("r"))
        out["pool_steps_per_s"] = min(x[1] for x in k.value("r"))
        k.ok("%ddp stop", timeout=60)
    finally:
        k.shutdown()
    return out


def _bench(stdout: str) -> dict:
    found = {}
    for line in stdout.splitlines():
        if line.startswith("BENCH "):
            item = json.loads(line[6:])
            found[item["name"]] = item["value"]
    return found


def peer_kernel(which: str, steps: int) -> dict:
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo"})
    try:
        k.ok(COMMON + "\nimport torch, socket")
        if which == "lightning":
            launch = ("from lightning_fabric import Fabric\nos.environ.pop('MASTER_PORT', None)\nT0 = time.time()\n"
                      f"r = Fabric(accelerator='cpu', devices=2, strategy='ddp_notebook').launch("
                      f"lambda fabric: fabric.all_gather(torch.tensor(first_step(T0, {steps}))).tolist())")
        else:
            launch = ("from accelerate import notebook_launcher\nimport torch.distributed as dist\nout = []\n"
                      "with socket.socket() as s:\n    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
                      "def job(T0):\n    from accelerate import PartialState\n    PartialState(cpu=True)\n"
                      f"    r = torch.tensor(first_step(T0, {steps}))\n    g = [torch.zeros(2) for _ in range(2)]\n"
                      "    dist.all_gather(g, r)\n    if dist.get_rank() == 0:\n"
                      "        print('RESULT ' + json.dumps([x.tolist() for x in g]), flush=True)\n"
                      "T0 = time.time()\nnotebook_launcher(job, args=(T0,), num_processes=2, use_port=str(port))\n")
        res = k.ok(launch, timeout=300)
        if which == "lightning":
            r = k.value("r")
        else:
            line = next(ln for ln in res.stdout.splitlines() if "RESULT " in ln)
            r = json.loads(line.split("RESULT ", 1)[1])
        return {"first": max(x[0] for x in r), "steps_per_s": min(x[1] for x in r)}
    finally:
        k.shutdown()


def torchrun(steps: int) -> dict:
    d = tempfile.mkdtemp()
    script = Path(d) / "step.py"
    script.write_text(COMMON + textwrap.dedent(f"""
        import torch, torch.distributed as dist
        r = torch.tensor(first_step(float(os.environ["T0"]), {steps}))
        g = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(g, r)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps([x.tolist() for x in g]), flush=True)
        dist.destroy_process_group()
    """))
    env = {**os.environ, "T0": str(time.time()), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, env=env, timeout=300)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line[7:])
    return {"first": max(x[0] for x in r), "steps_per_s": min(x[1] for x in r)}


# -- 2. real data ----------------------------------------------------------------------------------------------
DATA = r'''
import gc, json, time, psutil, torch, numpy as np, pandas as pd
import nbddp
from nbddp.rank.copywatch import private_bytes
def bench(name, value):
    print("BENCH " + json.dumps({{"name": name, "value": value}}), flush=True)
N = {n}
r0 = psutil.Process().memory_info().rss
rows = [{{"id": i, "text": f"sample text number {{i}}", "label": i % 7}} for i in range(N)]
bench("rows_mb", (psutil.Process().memory_info().rss - r0) / 2**20)
r0 = psutil.Process().memory_info().rss
frame = pd.DataFrame({{"text": pd.array([f"sample text number {{i}}" for i in range(N)], dtype=pd.StringDtype("python")),
                      "label": np.arange(N) % 7}})
bench("frame_mb", (psutil.Process().memory_info().rss - r0) / 2**20)
t = time.perf_counter(); shared_rows = nbddp.shared(rows); bench("shared_rows_s", time.perf_counter() - t)
t = time.perf_counter(); shared_frame = nbddp.shared(frame); bench("shared_frame_s", time.perf_counter() - t)
bench("shared_rows_mb", shared_rows._buf.size / 2**20)

class Items(torch.utils.data.Dataset):  # item i of a list of dicts, or of a DataFrame's string column
    def __init__(self, data):
        self.data = data
        self.text = data["text"] if hasattr(data, "columns") else None
    def __len__(self):
        return len(self.data)
    def __getitem__(self, i):
        return len(self.text.iat[i]) if self.text is not None else self.data[i]["label"]

def _started(_):
    global _base
    _base = private_bytes()

def _collate(items):
    return torch.utils.data.get_worker_info().id, sum(items), private_bytes() - _base

def read_half(data, rank, world, workers):
    """This rank's half of ``data``: its private memory growth (MiB), and with workers each worker's."""
    torch.set_num_threads(1)
    ds = Items(data)
    base = private_bytes()
    if not workers:
        total = sum(ds[i] for i in range(rank, len(ds), world))
        return (private_bytes() - base) / 2**20, [], total
    idx = list(range(rank, len(ds), world))
    loader = torch.utils.data.DataLoader(ds, batch_size=5000, sampler=idx, num_workers=workers,
                                         worker_init_fn=_started, collate_fn=_collate)
    per_worker, total = {{}}, 0
    for w, s, grew in loader:
        per_worker[w] = max(per_worker.get(w, 0), grew / 2**20)
        total += s
    return (private_bytes() - base) / 2**20, sorted(per_worker.values()), total
'''

DATA_CELL = "%%ddp --devices 2 --gather got\ngot = read_half({name}, rank, world_size, {workers})\n"
FABRIC_CELL = ("from lightning_fabric import Fabric\nos.environ.pop('MASTER_PORT', None)\n"
               "got = Fabric(accelerator='cpu', devices=2, strategy='ddp_notebook').launch("
               "lambda fabric: [read_half({name}, fabric.global_rank, 2, {workers})])\n")  # rank 0's comes back


def data(n: int) -> dict:
    k = Kernel(env={"NBDDP_RUNS_DIR": tempfile.mkdtemp(), "GLOO_SOCKET_IFNAME": "lo"})
    out = {}
    try:
        k.ok("%load_ext nbddp\nimport os")
        out.update(_bench(k.ok(DATA.format(n=n), timeout=600).stdout))
        for name in ("rows", "shared_rows", "frame", "shared_frame"):
            for workers in (0, 2):
                k.ok(DATA_CELL.format(name=name, workers=workers), timeout=600)
                got = k.value("got")
                out[f"nbddp {name} w{workers}"] = {"rank_mb": [g[0] for g in got], "worker_mb": [g[1] for g in got],
                                                   "total": sum(g[2] for g in got)}
                k.ok(FABRIC_CELL.format(name=name, workers=workers), timeout=600)
                got = k.value("got")  # rank 0's (Fabric returns rank 0's value)
                out[f"lightning {name} w{workers}"] = {"rank_mb": [g[0] for g in got],
                                                       "worker_mb": [g[1] for g in got]}
                print("done:", name, workers, flush=True)
    finally:
        k.shutdown()
    return out


def measure(quick: bool) -> dict:
    steps = 50 if quick else STEPS
    out = {"nbddp": nbddp_kernel(steps, True)}
    print("done: nbddp", flush=True)
    out["nbddp_no_warm"] = nbddp_kernel(steps, False)
    print("done: nbddp NBDDP_WARM=0", flush=True)
    out["lightning"] = peer_kernel("lightning", steps)
    out["accelerate"] = peer_kernel("accelerate", steps)
    out["torchrun"] = torchrun(steps)
    print("done: peers", flush=True)
    out["data"] = data(1_000_000 if quick else 3_000_000)
    out["quick"] = quick
    return out


def render(r: dict) -> str:
    n, off, tr = r["nbddp"], r["nbddp_no_warm"], r["torchrun"]
    li, ac = r["lightning"], r["accelerate"]

    def x(a, b):
        return f"{a / b:.2f}×"

    lines = [
        BEGIN,
        "## 9. A real first step and real data (issue 34)",
        "",
        "From a cell's start to the end of its ranks' first `DDP(Linear) + AdamW + backward + step` (the slower "
        f"rank), then steps/s over the next {50 if r['quick'] else STEPS} (the slower rank), 2 CPU ranks, gloo. Each "
        "launcher in a kernel of its own; torchrun from the command's start.",
        "",
        "| launcher | first step | × torchrun | steps/s after |",
        "|---|---|---|---|",
        f"| nbddp one-shot | {n['one_shot']:.2f} s | {x(n['one_shot'], tr['first'])} | {n['steps_per_s']:.0f} |",
        f"| nbddp one-shot, the cell right after `%load_ext` (waits for the warming thread) | "
        f"{n['right_after_load']:.2f} s | {x(n['right_after_load'], tr['first'])} | |",
        f"| nbddp pool, its first cell | {n['pool_first_cell']:.2f} s | {x(n['pool_first_cell'], tr['first'])} | "
        f"{n['pool_steps_per_s']:.0f} |",
        f"| nbddp one-shot, `NBDDP_WARM=0` (before issue 34) | {off['one_shot']:.2f} s | {x(off['one_shot'], tr['first'])} | "
        f"{off['steps_per_s']:.0f} |",
        f"| Lightning Fabric `ddp_notebook` | {li['first']:.2f} s | {x(li['first'], tr['first'])} | {li['steps_per_s']:.0f} |",
        f"| Accelerate `notebook_launcher` | {ac['first']:.2f} s | {x(ac['first'], tr['first'])} | {ac['steps_per_s']:.0f} |",
        f"| `torchrun --standalone` | {tr['first']:.2f} s | 1.00× | {tr['steps_per_s']:.0f} |",
        "",
        f"Goal: a fresh rank's first step ≤ 0.3 s: one-shot {n['one_shot']:.2f} s, pool {n['pool_first_cell']:.2f} s — "
        f"{'met' if max(n['one_shot'], n['pool_first_cell']) <= 0.3 else 'MISSED'} "
        f"({off['one_shot'] / n['one_shot']:.0f}× faster than without warming, {tr['first'] / n['one_shot']:.0f}× faster "
        "than torchrun's). "
        f"`%load_ext nbddp` after `import torch`: {n['load_ext_s']:.2f} s (goal ≤ 1 s). Warming the kernel (on its "
        f"own thread, from `%load_ext`): the kernel's RSS +{n['warm_rss_mb']:.0f} MiB. `NBDDP_WARM=0` turns it off.",
        "",
    ]
    d = r["data"]
    lines += [
        f"Real data: each rank reads its half, item by item (rows: a list of dicts, {d['rows_mb']:.0f} MiB in the "
        f"kernel; frame: a DataFrame whose string column is `StringDtype('python')`, {d['frame_mb']:.0f} MiB); "
        "private memory growth (USS) of each rank, and of each of its 2 DataLoader workers (with workers, the "
        "rank's own figure is the index list it builds for the loader's sampler, the same plain or shared). "
        "`nbddp.shared` took "
        f"{d['shared_rows_s']:.1f} s for the rows (a {d['shared_rows_mb']:.0f} MiB buffer) and "
        f"{d['shared_frame_s']:.1f} s for the frame.",
        "",
        "| data | launcher | per rank, no workers | per rank, 2 workers | per worker |",
        "|---|---|---|---|---|",
    ]

    def mb(v):
        return "/".join(f"{m:.0f}" for m in v) + " MiB"

    for name, size in (("rows", d["rows_mb"]), ("shared_rows", d["rows_mb"]), ("frame", d["frame_mb"]),
                       ("shared_frame", d["frame_mb"])):
        for who in ("nbddp", "lightning"):
            a, b = d[f"{who} {name} w0"], d[f"{who} {name} w2"]
            workers = [w for ws in b["worker_mb"] for w in ws]
            share = max(a["rank_mb"] + workers) / size
            lines.append(f"| `{name.replace('shared_', 'nbddp.shared(') + (')' if 'shared' in name else '')}` | "
                         f"{'nbddp' if who == 'nbddp' else 'Lightning ddp_notebook'} | {mb(a['rank_mb'])} | "
                         f"{mb(b['rank_mb'])} | {mb(workers)} (max {share:.1%} of the data) |")
    worst = max(max(d[f"nbddp {name} w0"]["rank_mb"] + [w for ws in d[f"nbddp {name} w2"]["worker_mb"] for w in ws])
                / size for name, size in (("shared_rows", d["rows_mb"]), ("shared_frame", d["frame_mb"])))
    same = all(d[f"nbddp {name} w0"]["total"] == d[f"nbddp shared_{name} w0"]["total"]
               == d[f"nbddp shared_{name} w2"]["total"] for name in ("rows", "frame"))
    lines += ["", f"Goal: reading a twin grows each rank and each worker by ≤ 5 % of the data: at most {worst:.1%} — "
              f"{'met' if worst <= 0.05 else 'MISSED'}; sums identical to the plain objects': {'yes' if same else 'NO'}.",
              "", END]
    return "\n".join(lines)


def write(r: dict) -> None:
    sections.save("firststep", r, render(r), BEGIN, END)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    r = measure(args.quick)
    write(r)
    print(render(r))


if __name__ == "__main__":
    main()
