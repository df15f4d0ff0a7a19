"""Issue 50's figures: what ``nbddp.log`` costs a rank, the kernel, and a pool cell, in one run.

python benchmarks/bench_metrics.py [--quick]   (benchmarks/run.py --only metrics runs it too)

1. **A call in a rank**: 200,000 ``nbddp.log(step=i, loss=x)`` in a 2-rank cell, per call; anchors in the same
   cell: the bare loop, and the loop building the same keyword dict and appending it with ``time.time()``.
2. **The kernel's CPU while ranks log 10,000 calls a second each**: a 2-rank cell pacing its calls for 5 s
   (10 calls every millisecond, two names a call), the kernel process's CPU time over the cell as a share of
   one core (``time.process_time`` in the kernel: every thread of it); the anchor: the same paced loop
   without the calls, in the same kernel.
3. **A pool cell's round trip** (median of interleaved cells): a trivial cell; one that logs once.

Writes results.json's "metrics" entry and the section between the markers in results.md.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from kernel import Kernel  # noqa: E402

import sections  # noqa: E402

BEGIN, END = "<!-- metrics:begin -->", "<!-- metrics:end -->"

CODE = r'''
%load_ext nbddp
import json, time, statistics
def bench(name, value):
    print("BENCH " + json.dumps({"name": name, "value": value}), flush=True)
N = {calls}
get_ipython().run_cell_magic("ddp", "--devices 2 --gather per_call bare made", """
import time, nbddp
N = %d
t0 = time.perf_counter()
for i in range(N):
    pass
bare = (time.perf_counter() - t0) / N
q = []
t0 = time.perf_counter()
for i in range(N):
    q.append((i, time.time(), dict(loss=0.5)))
made = (time.perf_counter() - t0) / N
t0 = time.perf_counter()
for i in range(N):
    nbddp.log(step=i, loss=0.5)
per_call = (time.perf_counter() - t0) / N
""" % N)
bench("call", {"log_us": max(per_call) * 1e6, "bare_us": max(bare) * 1e6, "append_us": max(made) * 1e6})

PACED = """
import time, nbddp
end = time.perf_counter() + %s
step = 0
while time.perf_counter() < end:
    tick = time.perf_counter()
    for _ in range(10):
        if %s:
            nbddp.log(step=step, loss=0.5, lr=0.1)
        step += 1
    while time.perf_counter() - tick < 0.001:
        pass
calls = step
"""
cpu = {}
for label, on in (("without", "False"), ("with", "True"), ("without", "False"), ("with", "True")):
    c0, t0 = time.process_time(), time.perf_counter()
    get_ipython().run_cell_magic("ddp", "--devices 2 --gather calls", PACED % ({seconds}, on))
    cpu.setdefault(label, []).append(((time.process_time() - c0) / (time.perf_counter() - t0), min(calls) / {seconds}))
bench("kernel", {k: {"core": min(c for c, _ in v), "calls_per_s": min(r for _, r in v)} for k, v in cpu.items()})

get_ipython().run_line_magic("ddp", "start --devices 2")
def cell(body):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", "", body)
    return time.perf_counter() - t0
cell("import nbddp")
plain, logged = [], []
for _ in range({cells}):
    plain.append(cell("pass"))
    logged.append(cell("nbddp.log(loss=0.5)"))
get_ipython().run_line_magic("ddp", "stop")
bench("pool", {"plain_s": statistics.median(plain), "logged_s": statistics.median(logged)})
'''


def measure(quick: bool = False) -> dict:
    from run import measures  # (run.py imports this module when it runs its section)

    code = CODE.replace("{calls}", "200_000").replace("{seconds}", "3" if quick else "5").replace("{cells}", "15" if quick else "40")
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo", "NBDDP_RUNS_DIR": tempfile.mkdtemp()})
    try:
        return measures(k.ok(code, timeout=1200))
    finally:
        k.shutdown()


def render(r: dict) -> str:
    call, kern, pool = r["call"], r["kernel"], r["pool"]
    w, wo = kern["with"], kern["without"]
    return "\n".join([
        "## 15. What the ranks log (`nbddp.log`, issue 50): a call, the kernel, a pool cell",
        "",
        "2 CPU ranks, gloo, one kernel; a call's figures are the slower rank's.",
        "",
        "| | per call |",
        "|---|---|",
        f"| `nbddp.log(step=i, loss=x)` in a rank | {call['log_us']:.2f} µs |",
        f"| anchor: the same dict and `time.time()` appended to a list | {call['append_us']:.2f} µs |",
        f"| anchor: the bare loop | {call['bare_us']:.3f} µs |",
        "",
        f"Goal: a call ≤ 10 µs: {call['log_us']:.2f} µs — {'met' if call['log_us'] <= 10 else 'NOT met'}.",
        "",
        "| 2 ranks each pacing 10 calls a millisecond (two names a call) | calls a second per rank | kernel CPU (share of one core) |",
        "|---|---|---|",
        f"| without the calls (anchor: the same loop) | — | {wo['core']:.1%} |",
        f"| with `nbddp.log` | {w['calls_per_s']:,.0f} | {w['core']:.1%} |",
        "",
        f"Goal: the kernel under 5 % of a core at 10,000 calls a second per rank: {w['core'] - wo['core']:.1%} over the "
        f"anchor ({w['core']:.1%} in all) — {'met' if w['core'] - wo['core'] < 0.05 else 'NOT met'}.",
        "",
        "| pool cell (median, interleaved) | round trip |",
        "|---|---|",
        f"| trivial (`pass`) | {pool['plain_s'] * 1000:.2f} ms |",
        f"| one `nbddp.log` call | {pool['logged_s'] * 1000:.2f} ms ({pool['logged_s'] / pool['plain_s']:.2f}×) |",
    ])


def write(r: dict) -> None:
    sections.save("metrics", r, f"{BEGIN}\n{render(r)}\n\n{END}", BEGIN, END, before="## GPU (issue 22)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    r = measure(ap.parse_args().quick)
    write(r)
    print(render(r))
