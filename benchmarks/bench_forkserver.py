"""Issue 49's figures: the forkserver against fork and spawn, and notebook tensors through shared memory, in
one run.

python benchmarks/bench_forkserver.py [--quick]   (benchmarks/run.py --only forkserver runs it too)

1. **One-shot cells by start method** (fork, forkserver, spawn), each in a kernel of its own holding a 1 GiB
   tensor ``X``: a trivial cell with one all_reduce (median), a real first step (``DDP(Linear) + AdamW +
   backward + step``, from the cell's start to the slower rank's end of it), and a cell reading ``X`` whole
   (time, each rank's private memory growth while it reads, USS from smaps_rollup). The forkserver kernel
   first runs ``torch.cuda``-free code only: on CPU the server is the same whether or not the kernel holds
   CUDA; what it changes is which start method a GPU cell gets.
2. **A pool cell reading 1 GiB made after ``%ddp start``**, fork pool: the first cell that reads it, the
   next one (unchanged), and the one after ``X.add_(1)`` in the notebook; this code (shared memory) and
   "before" (``sharedtensor.sharing`` off: the pickle per rank nbddp sent until issue 49), same run.

Writes results.json's "forkserver" entry and the section between the markers in results.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from kernel import Kernel  # noqa: E402

BEGIN, END = "<!-- forkserver:begin -->", "<!-- forkserver:end -->"

COMMON = r'''
%load_ext nbddp
import json, time, statistics, torch
def bench(name, value):
    print("BENCH " + json.dumps({"name": name, "value": value}), flush=True)
def private():
    total = 0
    with open('/proc/self/smaps_rollup') as f:
        for line in f:
            if line.startswith(('Private_Clean:', 'Private_Dirty:')):
                total += int(line.split()[1]) * 1024
    return total
X = torch.ones(256 * 2**20)  # 1 GiB
'''

ONE_SHOT = r'''
def cell(body, opts=""):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", f"--devices 2 --start-method {METHOD} {opts}", body)
    return time.perf_counter() - t0
TRIVIAL = "t = torch.ones(1)\ntorch.distributed.all_reduce(t)\n"
FIRST = """
t0 = time.time()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters())
opt.zero_grad(); torch.nn.functional.mse_loss(model(torch.randn(32, 64)), torch.randn(32, 1)).backward(); opt.step()
took = time.time()
"""
READ = """
base = private()
s = float(X.sum())
grew = private() - base
"""
cell(TRIVIAL)  # warm-up (the forkserver: started and given the kernel's imports here)
trivial = statistics.median(cell(TRIVIAL) for _ in range({runs}))
firsts = []
for _ in range({runs}):
    t0 = time.time()
    get_ipython().run_cell_magic("ddp", f"--devices 2 --start-method {METHOD} --gather took", FIRST)
    firsts.append(max(took) - t0)
reads, grown = [], []
for _ in range({runs}):
    reads.append(cell(READ, "--gather grew"))
    grown.append(max(grew))
bench("one_shot", {"trivial_s": trivial, "first_step_s": statistics.median(firsts), "read_1gib_s": statistics.median(reads),
                   "read_private_mib": max(grown) / 2**20})
'''

POOL = r'''
import nbddp.wire.sharedtensor as st
st._enabled = SHARED
get_ipython().run_line_magic("ddp", "start --devices 2")
del X
X = torch.ones(256 * 2**20)  # made after the start
def cell(body):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", "--gather grew", body)
    return time.perf_counter() - t0
READ = "base = private()\ns = float(X.sum())\ngrew = private() - base\n"
first = cell(READ); first_grew = max(grew)
again = cell(READ)
X.add_(1)
changed = cell(READ); changed_grew = max(grew)
ok = cell("grew = [float(X[0])]") and grew == [[2.0], [2.0]]
get_ipython().run_line_magic("ddp", "stop")
bench("pool", {"first_s": first, "first_private_mib": first_grew / 2**20, "unchanged_s": again,
               "changed_s": changed, "changed_private_mib": changed_grew / 2**20, "fresh_values": ok})
'''


def measures(res) -> dict:
    out = {}
    for line in res.stdout.splitlines():
        if "BENCH " in line and not line.startswith("[rank"):
            item = json.loads(line.split("BENCH ", 1)[1])
            out[item["name"]] = item["value"]
    return out


def in_kernel(code: str, env=None) -> dict:
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo", "NBDDP_RUNS_DIR": tempfile.mkdtemp(), **(env or {})})
    try:
        k.ok(COMMON, timeout=300)
        return measures(k.ok(code, timeout=1200))
    finally:
        k.shutdown()


def measure(quick: bool = False) -> dict:
    runs = 3 if quick else 5
    out = {"one_shot": {}, "pool": {}}
    for method in ("fork", "forkserver", "spawn"):
        got = in_kernel(f"METHOD = {method!r}\n" + ONE_SHOT.replace("{runs}", str(runs)))
        out["one_shot"][method] = got["one_shot"]
        print("done:", method, got["one_shot"], flush=True)
    for label, shared in (("before", False), ("this code", True)):
        got = in_kernel(f"SHARED = {shared}\n" + POOL)
        out["pool"][label] = got["pool"]
        print("done: pool", label, got["pool"], flush=True)
    return out


def render(r: dict) -> str:
    one, pool = r["one_shot"], r["pool"]
    fork = one["fork"]
    lines = [
        "## 14. Never restart, never copy: the forkserver and notebook tensors through shared memory (issue 49)",
        "",
        "Each start method in a kernel of its own holding a 1 GiB tensor `X`, 2 CPU ranks, gloo; medians. `read X` is "
        "a cell reading all of `X` on both ranks; private memory is each rank's USS growth while it reads (the "
        "larger rank).",
        "",
        "| start method | trivial cell | × fork | first DDP + AdamW step | × fork | read X (1 GiB) | rank private memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in ("fork", "forkserver", "spawn"):
        m = one[method]
        lines.append(f"| {method} | {m['trivial_s'] * 1000:.0f} ms | {m['trivial_s'] / fork['trivial_s']:.2f}× | "
                     f"{m['first_step_s'] * 1000:.0f} ms | {m['first_step_s'] / fork['first_step_s']:.2f}× | "
                     f"{m['read_1gib_s']:.2f} s | {m['read_private_mib']:.0f} MiB |")
    fs = one["forkserver"]
    met = fs["trivial_s"] <= 1.5 * fork["trivial_s"] and fs["first_step_s"] <= 1.5 * fork["first_step_s"]
    lines += ["", f"Goal: a forkserver one-shot cell ≤ 1.5× a forked one (trivial, first step): "
              f"{fs['trivial_s'] / fork['trivial_s']:.2f}× and {fs['first_step_s'] / fork['first_step_s']:.2f}× — "
              f"{'met' if met else 'NOT met'}. Notebook data: forkserver ranks read 1 GiB with "
              f"{fs['read_private_mib']:.0f} MiB private each (goal < 64 MiB: "
              f"{'met' if fs['read_private_mib'] < 64 else 'NOT met'}); spawn's ranks, "
              f"{one['spawn']['read_private_mib']:.0f} MiB.", "",
              "A fork pool's cell reading a 1 GiB tensor made after `%ddp start` (each row in a kernel of its own; "
              "\"before\": the pickle per rank nbddp sent until issue 49, `sharedtensor.sharing` off):", "",
              "| | first cell | rank private memory | next cell (unchanged) | after `X.add_(1)` | rank private memory | values fresh |",
              "|---|---|---|---|---|---|---|"]
    for label in ("before", "this code"):
        p = pool[label]
        lines.append(f"| {label} | {p['first_s']:.2f} s | {p['first_private_mib']:.0f} MiB | {p['unchanged_s'] * 1000:.0f} ms | "
                     f"{p['changed_s']:.2f} s | {p['changed_private_mib']:.0f} MiB | {'yes' if p['fresh_values'] else 'no'} |")
    p = pool["this code"]
    lines += ["", f"Goals: 1 GiB reaches every rank with < 64 MiB private memory per rank ({p['first_private_mib']:.0f} MiB), "
              f"the first time in ≤ 1 s ({p['first_s']:.2f} s, the cell's whole time) and ≤ 5 ms when unchanged "
              f"(the whole unchanged cell: {p['unchanged_s'] * 1000:.0f} ms, nothing sent); an in-place change in the "
              "notebook is seen by the next cell (before: the old values, silently)."]
    return "\n".join(lines)


def write(r: dict) -> None:
    results = json.loads((HERE / "results.json").read_text())
    results["forkserver"] = r
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    md = (HERE / "results.md").read_text()
    block = f"{BEGIN}\n{render(r)}\n\n{END}"
    if BEGIN in md:
        md = md[:md.index(BEGIN)] + block + md[md.index(END) + len(END):]
    else:
        at = md.index("## GPU (issue 22)")
        md = md[:at] + block + "\n\n" + md[at:]
    (HERE / "results.md").write_text(md)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    r = measure(ap.parse_args().quick)
    write(r)
    print(render(r))
