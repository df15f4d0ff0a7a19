"""Issue 44, point 5: is queueing a pool cell's line on ipykernel's IO thread without a wake
(views/iopub.py's ``queue_without_wake``, ipykernel's private internals) worth it against the ordinary
way (``session.send``: a wake of its own)? ``python benchmarks/bench_iopub.py [--rounds N]``.

One kernel, one pool of 2 ranks, a trivial cell (one all_reduce, as section 1c's), the two ways
interleaved (each first in every other round), with the floor (two forked ranks on a pipe, nothing of
nbddp) as the anchor of the same kernel:
- in the kernel: the cell's own time, the IO thread drained between cells as between notebook cells;
- a loop of pool cells in one notebook cell (as section 1c times them): blocks of cells each way in turn,
  nothing draining the IO thread between a block's cells, the floor after each cell;
- from the client: a notebook cell that runs the pool cell, execute request to idle status (what a user
  waits for; the line goes out with the kernel's ``Out[]``/idle wake or with its own).
Prints medians and a JSON line; results.md's section 13 holds the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kernel_code as kc  # noqa: E402
from run import measures, new_kernel  # noqa: E402

IN_KERNEL = kc.FLOOR_CODE + r"""
import threading
FLOOR = floor_start()
CELL = "t = torch.ones(1)\ndist.all_reduce(t)\n;"
_io = get_ipython().display_pub.pub_socket.io_thread

def drain():  # the IO thread sends what it holds, as between notebook cells
    ev = threading.Event()
    _io.schedule(ev.set)
    ev.wait(5)
    time.sleep(0.002)

def pool_cell(queued):
    _iopub.QUEUED = queued
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", "", CELL)
    dt = time.perf_counter() - t0
    drain()
    return dt

def anchor():
    dt = floor_cell()
    drain()
    return dt

get_ipython().run_line_magic("ddp", "start --devices 2")
for _ in range(20):
    pool_cell(True); pool_cell(False); anchor()
got = {True: [], False: [], "floor": []}
for i in range({runs}):
    order = [True, False, "floor"] if i % 2 == 0 else [False, True, "floor"]
    for mode in order:
        got[mode].append(anchor() if mode == "floor" else pool_cell(mode))
# a loop of pool cells in one notebook cell (section 1c's way): nothing drains the IO thread between them;
# blocks of BLOCK cells, each way in turn (a block's first cell pays for the last block's wake: left out)
BLOCK = 20
loop = {True: [], False: [], "floor": []}
for i in range(max(1, {runs} // BLOCK)):
    for mode in ([True, False] if i % 2 == 0 else [False, True]):
        _iopub.QUEUED = mode
        times = []
        for _ in range(BLOCK):
            t0 = time.perf_counter()
            get_ipython().run_cell_magic("ddp", "", CELL)
            times.append(time.perf_counter() - t0)
            loop["floor"].append(floor_cell())
        loop[mode] += times[1:]
        drain()
_iopub.QUEUED = True
floor_stop(FLOOR)
bench("iopub_in_kernel", {"queued": statistics.median(got[True]), "fallback": statistics.median(got[False]),
                          "floor": statistics.median(got["floor"]), "n": len(got[True])})
bench("iopub_loop", {"queued": statistics.median(loop[True]), "fallback": statistics.median(loop[False]),
                     "floor": statistics.median(loop["floor"]), "n": len(loop[True])})
"""


def client_side(k, rounds: int) -> dict:
    """Execute request to idle, per notebook cell: the pool cell with its line queued, or sent the
    ordinary way (the way set by a cell of its own before, not timed), and a notebook cell that does
    nothing as the anchor."""
    k.ok("from nbddp.views import iopub as _iopub\n"
         "_CELL = 't = torch.ones(1)\\ndist.all_reduce(t)\\n;'")

    def cell(queued: bool) -> float:
        k.ok(f"_iopub.QUEUED = {queued}")
        return k.ok("get_ipython().run_cell_magic('ddp', '', _CELL)").seconds

    for _ in range(10):
        cell(True), cell(False)
    got = {True: [], False: [], "plain": []}
    for i in range(rounds):
        for mode in ([True, False] if i % 2 == 0 else [False, True]):
            got[mode].append(cell(mode))
        got["plain"].append(k.ok("pass").seconds)
    k.ok("_iopub.QUEUED = True")
    return {"queued": statistics.median(got[True]), "fallback": statistics.median(got[False]),
            "plain": statistics.median(got["plain"]), "n": rounds}


def measure(rounds: int) -> dict:
    k = new_kernel()
    try:
        out = measures(k.ok(IN_KERNEL.replace("{runs}", str(rounds)), timeout=600))
        out["iopub_client"] = client_side(k, rounds)
        k.ok("%ddp stop")
        return out
    finally:
        k.shutdown()


def render(r: dict) -> str:
    """results.md's section 12."""
    ik, lp, cl = r["iopub_in_kernel"], r["iopub_loop"], r["iopub_client"]

    def ms(x):
        return f"{x * 1e3:.2f} ms"

    def row(label, f, anchor, anchor_label):
        return (f"| {label} | {ms(f['queued'])} | {ms(f['fallback'])} | {ms(f['fallback'] - f['queued'])} "
                f"({(f['fallback'] - f['queued']) / f['fallback']:+.0%}) | {anchor_label} {ms(f[anchor])} |")

    lo, hi = sorted((f["fallback"] - f["queued"]) / f["fallback"] for f in (ik, lp))
    span = f"{lo:.0%} to {hi:.0%}" if f"{lo:.0%}" != f"{hi:.0%}" else f"about {lo:.0%}"
    return "\n".join([
        "## 12. A pool cell's line: queued on ipykernel's IO thread, or sent the ordinary way (issue 44)", "",
        f"`python benchmarks/bench_iopub.py --rounds {r['rounds']}`: a trivial pool cell (one gloo all_reduce, 2 ranks), "
        "its line queued without a wake (views/iopub.py's `queue_without_wake`, ipykernel's private IOPubThread "
        "internals) against sent the ordinary way (`session.send`, a wake of its own), interleaved in one kernel (each "
        "way first in every other round), medians:", "",
        "| measured | queued | ordinary send | saved | anchor (same run) |", "|---|---|---|---|---|",
        row(f"the cell's own time, each alone, the IO thread drained between ({ik['n']} each)", ik, "floor", "the floor"),
        row(f"the cell's own time, {lp['n']} each in a loop in one notebook cell (section 1c's way)", lp, "floor", "the floor"),
        row(f"a notebook cell running it, request to idle, from the client ({cl['n']} each)", cl, "plain", "a cell doing nothing"),
        "", "The floor: two forked ranks on a pipe, one all_reduce, nothing of nbddp. Decision: kept. The queued line "
        f"takes {span} off the pool cell's own time, alone or back to back, which is what sections 1c and "
        "10 hold to their targets; a client waiting for one notebook cell sees the same request-to-idle either way (the "
        "IO thread's work moves after the cell, before the idle status). The private use is one function, checked once "
        "per IO thread, with the ordinary send as its fallback (tests/test_pool_view.py, on ipykernel 7.x and 6.17)."])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    r = {**measure(args.rounds), "rounds": args.rounds}
    ik, lp, cl = r["iopub_in_kernel"], r["iopub_loop"], r["iopub_client"]
    print(f"in the kernel ({ik['n']} each): queued {ik['queued'] * 1e3:.3f} ms, fallback {ik['fallback'] * 1e3:.3f} ms, "
          f"floor {ik['floor'] * 1e3:.3f} ms; saved {(ik['fallback'] - ik['queued']) * 1e3:.3f} ms")
    print(f"a loop in one cell ({lp['n']} each): queued {lp['queued'] * 1e3:.3f} ms, fallback {lp['fallback'] * 1e3:.3f} ms, "
          f"floor {lp['floor'] * 1e3:.3f} ms; saved {(lp['fallback'] - lp['queued']) * 1e3:.3f} ms")
    print(f"from the client ({cl['n']} each): queued {cl['queued'] * 1e3:.3f} ms, fallback {cl['fallback'] * 1e3:.3f} ms, "
          f"a plain cell {cl['plain'] * 1e3:.3f} ms; saved {(cl['fallback'] - cl['queued']) * 1e3:.3f} ms")
    path = HERE / "results.json"  # run.py writes it into results.md (section 12) with the rest
    path.write_text(json.dumps({**json.loads(path.read_text()), "iopub": r}, indent=1))
    print(render(r))


if __name__ == "__main__":
    main()
