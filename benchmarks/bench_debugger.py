"""JupyterLab's debugger panel in the ranks (issue 43): "no debugger attached costs nothing", measured from a
client as a front end sees it (execute request to idle), in one run, interleaved:

- pool cells: a trivial pool cell (one gloo all_reduce, 2 ranks, as section 11's) in eight kernels of
  their own, each with its pool, one cell each in turn (the order rotated every round):
  ``a`` this code, the debugger never on; ``b`` the code before the feature (git revision ``BEFORE`` in a
  worktree on the kernel's PYTHONPATH, as before_after.py does it); ``a2``, ``b2`` the same again (the A/A and
  B/B spread); ``c`` this code with JupyterLab's debugger on (tests/debugclient.py: initialize, attach,
  configurationDone; no breakpoints), the pool attached; ``d`` this code after the debugger was on (the pool
  attached) and turned off again; ``cb``, ``db`` the same with the code before (its ranks never reached: what
  ipykernel's own debugger costs the kernel). Each kernel's anchor, in turn with them: a notebook cell doing
  nothing (``pass``).
- one-shot cells (``%%ddp --devices 2``, fork per cell), two more kernels, in turn: the cell's full run without
  the debugger, against, with the debugger on, the time from its execute request to both ranks' ``stopped``
  events at a breakpoint on its second line (its full run too: continued at once), and the same cell with no
  breakpoint in it.

python benchmarks/run.py --only debugger     (python benchmarks/bench_debugger.py [--quick] prints the JSON)
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (HERE, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import kernel_code as kc  # noqa: E402
from debugclient import DebugClient  # noqa: E402
from kernel import Kernel, said  # noqa: E402

BEFORE = "f887171"  # the last commit before the debugger panel (d515dec)
POOL_CELL = "%%ddp\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)"  # section 11's
ANCHOR = "pass"
ONE_SHOT = "%%ddp --devices 2\nx = 41 + rank\ny = x * 2\nprint('done', rank, y)"
ONE_SHOT_FREE = ONE_SHOT + "\n# (no breakpoint in this cell)"  # another cell, so another file: no breakpoint
POOL_KERNELS = ("a", "b", "a2", "b2", "c", "cb", "d", "db")  # (started in this order: each side's first and second)
OLD = ("b", "b2", "cb", "db")  # the kernels of the code before the feature
TRACED = """%%ddp
import sys
monitoring = getattr(sys, 'monitoring', None)  # (pydevd's way on Python 3.12+)
print('traced', rank, sys.gettrace() is not None or bool(monitoring and monitoring.get_tool(monitoring.DEBUGGER_ID)))
"""  # tests/test_debug_panel.py's


def _kernel(src: Path) -> Kernel:
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo", "NBDDP_RUNS_DIR": tempfile.mkdtemp(), "PYTHONPATH": str(src)})
    found = k.value("__import__('nbddp').__file__")
    assert found.startswith(str(src)), f"the kernel imported nbddp from {found}, not {src}"
    k.ok(kc.SETUP)
    k.ok("from nbddp.kernel.ranks import warm\nwarm.wait()")
    return k


def _timed(k: Kernel, code: str) -> float:
    t0 = time.perf_counter()
    k.ok(code)
    dt = time.perf_counter() - t0
    k.stray.clear()  # (the debugger's events and nothing else: no one follows them)
    return dt


def _check_traced(kernels: dict) -> dict:
    """c's ranks traced, nobody else's (d's let go); whether each kernel's own main thread is."""
    kernel_traced = {}
    for name, k in kernels.items():
        out = k.ok(TRACED).stdout
        assert all(said(out, r, f"traced {r} {name == 'c'}") for r in (0, 1)), (name, out)
        kernel_traced[name] = k.value("__import__('sys').gettrace() is not None")
        k.stray.clear()
    return kernel_traced


def _tree_cpu(k: Kernel) -> float:
    """CPU seconds so far of the kernel and its children (the ranks, debugpy's adapter)."""
    total = 0.0
    p = k.process()
    for q in [p, *p.children(recursive=True)]:
        try:
            c = q.cpu_times()
            total += c.user + c.system
        except Exception:  # noqa: BLE001 - a child gone meanwhile
            pass
    return total


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4)
    return {"n": len(xs), "median_ms": statistics.median(xs) * 1e3, "q1_ms": q[0] * 1e3, "q3_ms": q[2] * 1e3,
            "min_ms": xs[0] * 1e3}


def pool_cells(kernels: dict, rounds: int) -> dict:
    times = {name: {"cell": [], "anchor": []} for name in kernels}
    names = list(kernels)
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for what, code in (("cell", POOL_CELL), ("anchor", ANCHOR))[::1 if i % 2 == 0 else -1]:
            for name in order:
                times[name][what].append(_timed(kernels[name], code))
    return times


def one_shot_cells(off: Kernel, on: Kernel, panel: DebugClient, rounds: int) -> dict:
    got = {"off": [], "to_stopped": [], "stopped_full": [], "on_no_breakpoint": []}

    def stopped_run():
        since = len(panel.events)
        t0 = time.perf_counter()
        msg_id = on.execute(ONE_SHOT)
        panel.stopped(2, since=since)
        t1 = time.perf_counter()
        panel.ok("continue", {"threadId": 1})  # JupyterLab's Continue: every rank
        res = on.collect(msg_id, timeout=120)
        t2 = time.perf_counter()
        assert res.error is None and "done" in res.stdout, res
        on.stray.clear()
        got["to_stopped"].append(t1 - t0)
        got["stopped_full"].append(t2 - t0)

    steps = [lambda: got["off"].append(_timed(off, ONE_SHOT)), stopped_run,
             lambda: got["on_no_breakpoint"].append(_timed(on, ONE_SHOT_FREE))]
    for i in range(rounds):
        for step in steps[i % 3:] + steps[:i % 3]:
            step()
    return got


def measure(quick: bool) -> dict:
    rounds, shots = (60, 6) if quick else (300, 30)
    tree = Path(tempfile.mkdtemp(prefix="nbddp-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), BEFORE], check=True,
                   capture_output=True)
    kernels: dict[str, Kernel] = {}
    try:
        for name in POOL_KERNELS:
            kernels[name] = k = _kernel(tree if name in OLD else ROOT)
            k.ok("%ddp start --devices 2")
            for _ in range(5):
                k.ok(POOL_CELL)  # the pool ran before any debugger
        panels = {name: DebugClient(kernels[name]) for name in ("c", "cb", "d", "db")}
        for name, panel in panels.items():
            panel.start()
            for _ in range(5):
                _timed(kernels[name], POOL_CELL)  # the ranks attach (their next cell)
        assert said(kernels["d"].ok(TRACED).stdout, 0, "traced 0 True")
        panels["d"].stop()
        panels["db"].stop()
        for name in POOL_KERNELS:
            for _ in range(10):
                _timed(kernels[name], POOL_CELL)  # d's ranks let go (their next cell); all warm alike
        kernel_traced = _check_traced(kernels)
        cpu0 = {name: _tree_cpu(k) for name, k in kernels.items()}
        t0 = time.monotonic()
        times = pool_cells(kernels, rounds)
        span = time.monotonic() - t0
        cpu = {name: _tree_cpu(k) - cpu0[name] for name, k in kernels.items()}
        idle0 = {name: _tree_cpu(k) for name, k in kernels.items()}
        time.sleep(3.0)  # (a measuring window: what each kernel and its ranks spend doing nothing)
        idle = {name: (_tree_cpu(k) - idle0[name]) / 3.0 for name, k in kernels.items()}
        assert _check_traced(kernels) == kernel_traced
        for k in kernels.values():
            k.ok("%ddp stop")
            k.shutdown()
        kernels.clear()
        kernels["off"] = off = _kernel(ROOT)
        kernels["on"] = on = _kernel(ROOT)
        panel = DebugClient(on)
        panel.start()
        panel.breakpoints(ONE_SHOT, [2])  # `x = 41 + rank`, the cell's second line
        for k, code in ((off, ONE_SHOT), (on, ONE_SHOT_FREE)):
            _timed(k, code)  # warm
        shots_got = one_shot_cells(off, on, panel, shots)
        panel.stop()
    finally:
        for k in kernels.values():
            k.shutdown()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    pool = {name: {"cell": _stats(t["cell"]), "anchor": _stats(t["anchor"]),
                   "cpu_per_cell_ms": cpu[name] / rounds * 1e3, "idle_cpu": idle[name],
                   "kernel_traced": kernel_traced[name]} for name, t in times.items()}
    med = {name: statistics.median(t["cell"]) for name, t in times.items()}
    pooled = {side: statistics.median(times[x]["cell"] + times[y]["cell"])
              for side, x, y in (("this", "a", "a2"), ("before", "b", "b2"))}
    ratios = {"a/b": med["a"] / med["b"], "a2/a": med["a2"] / med["a"], "b2/b": med["b2"] / med["b"],
              "this/before": pooled["this"] / pooled["before"], "c/a": med["c"] / med["a"],
              "d/a": med["d"] / med["a"], "cb/b": med["cb"] / med["b"], "db/b": med["db"] / med["b"],
              "c/cb": med["c"] / med["cb"], "d/db": med["d"] / med["db"]}
    # the run's spread of a/b: the ratio of medians over each quarter of the rounds (drift shows here)
    quarter = rounds // 4
    per_quarter = {key: [statistics.median(times[x]["cell"][j * quarter:(j + 1) * quarter])
                         / statistics.median(times[y]["cell"][j * quarter:(j + 1) * quarter]) for j in range(4)]
                   for key, (x, y) in {"a/b": ("a", "b"), "a2/a": ("a2", "a"), "b2/b": ("b2", "b"),
                                       "d/a": ("d", "a"), "d/db": ("d", "db")}.items()}
    return {"rev": BEFORE, "commit": _commit(), "rounds": rounds, "seconds": span, "pool": pool, "ratios": ratios,
            "quarters": per_quarter, "one_shot": {k: _stats(v) for k, v in shots_got.items()}, "load": _load()}


def _commit() -> str:
    """The commit measured as "this code", with "+changes" where the tree differs from it under nbddp/."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "nbddp"], capture_output=True,
                           text=True).stdout.strip()
    return head.stdout.strip() + (" +changes" if dirty else "")


def _load() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def render(r: dict) -> str:
    p, q, o, ra = r["pool"], r["quarters"], r["one_shot"], r["ratios"]

    def row(name: str, label: str) -> str:
        c, a = p[name]["cell"], p[name]["anchor"]
        return (f"| {label} | {c['median_ms']:.2f} ms ({c['q1_ms']:.2f}–{c['q3_ms']:.2f}) | "
                f"{c['median_ms'] / p['a']['cell']['median_ms']:.3f} | {a['median_ms']:.2f} ms "
                f"({a['q1_ms']:.2f}–{a['q3_ms']:.2f}) | {c['median_ms'] - a['median_ms']:.2f} ms | "
                f"{p[name]['cpu_per_cell_ms']:.1f} ms |")

    def quarters(key: str) -> str:
        return ", ".join(f"{x:.3f}" for x in q[key])

    off = o["off"]["median_ms"]
    kernel_after = "not" if p["d"]["kernel_traced"] and p["db"]["kernel_traced"] else \
        f"(this run: traced d {p['d']['kernel_traced']}, d before {p['db']['kernel_traced']})"
    ab_ok = ra["a/b"] <= 1.05 and ra["this/before"] <= 1.05
    d_ok = ra["d/db"] <= 1.05
    return "\n".join([
        "## 13. The debugger panel in the ranks (issue 43): no debugger, no cost",
        "",
        f"`python benchmarks/run.py --only debugger` (benchmarks/bench_debugger.py): a trivial pool cell (one gloo "
        f"all_reduce, 2 ranks, section 11's cell), execute request to idle as a client sees it, in {len(p)} kernels "
        f"of their own, each with its pool of 2 ranks, one cell each in turn, the order rotated every round, "
        f"{r['rounds']} cells each ({r['seconds']:.0f} s). Anchor: a notebook cell doing nothing (`pass`) in the "
        f"same kernel, {r['rounds']} each, in turn with them. This code: {r.get('commit', '')}; \"before\": git "
        f"revision {r['rev']}, the commit before the feature, in a worktree on the kernel's PYTHONPATH (as before_after.py). The debugger is turned on and "
        "off as JupyterLab's panel does it over the control channel (tests/debugclient.py), with no breakpoints; "
        "nothing asks for variables between cells. Medians (interquartile range):",
        "",
        "| kernel | pool cell | × a | anchor: empty cell | cell − anchor | CPU a cell (kernel + ranks + adapter) |",
        "|---|---|---|---|---|---|",
        row("a", "a. this code, the debugger never on"),
        row("a2", "a2. the same again, a kernel of its own (A/A)"),
        row("b", "b. before the feature"),
        row("b2", "b2. the same again, a kernel of its own (B/B)"),
        row("c", "c. this code, the debugger on, the pool attached"),
        row("cb", "c before: the debugger on (the kernel only: the ranks are not reached)"),
        row("d", "d. this code, the debugger turned on (the pool attached) and off again"),
        row("db", "d before: the debugger turned on and off again"),
        "",
        f"a / b = {ra['a/b']:.3f}; a2 / a = {ra['a2/a']:.3f} (A/A), b2 / b = {ra['b2/b']:.3f} (B/B); this code's "
        f"{2 * r['rounds']} cells (a, a2) against the code before's (b, b2): {ra['this/before']:.3f}. "
        f"c / a = {ra['c/a']:.2f} (c / c before {ra['c/cb']:.2f}); d / a = {ra['d/a']:.3f}, d before / b = {ra['db/b']:.3f}, d / d before = "
        f"{ra['d/db']:.3f}. The same over each quarter of the rounds: a / b {quarters('a/b')}; a2 / a "
        f"{quarters('a2/a')}; b2 / b {quarters('b2/b')}; d / a {quarters('d/a')}; d / d before {quarters('d/db')}.",
        "",
        f"Target: no debugger costs nothing, a / b and this code / before ≤ 1.05 — {'met' if ab_ok else '**not met**'}. "
        f"Once the debugger is off the ranks are untraced again (checked before and after the rounds), but the kernel "
        f"is {kernel_after}: "
        f"ipykernel's debugpy leaves its trace function on the kernel's main thread after the panel's disconnect "
        f"(`sys.gettrace()` stays pydevd's), whose cost every cell, the empty one too, keeps paying, with or "
        f"without nbddp — d before / b = {ra['db/b']:.2f}. nbddp's share of it, d / d before ≤ 1.05 — "
        f"{'met' if d_ok else '**not met**'}. With the debugger on (c) every cell runs traced by debugpy in the "
        f"kernel (c before, the same without the ranks) and in each rank (pydevd's trace function on every frame, "
        f"each rank a debugpy session of the kernel's adapter). Each kernel and its ranks, idle afterwards, 3 s: "
        + ", ".join(f"{name} {p[name]['idle_cpu']:.1%}" for name in p) + " of a core.",
        "",
        f"A one-shot cell (`%%ddp --devices 2`, fork per cell, 3 lines), {o['off']['n']} each, in turn, two more "
        "kernels (one with the debugger on, a breakpoint on the cell's second line):",
        "",
        "| one-shot cell | median (interquartile range) | × without the debugger |",
        "|---|---|---|",
        f"| without the debugger: execute request to idle | {off:.0f} ms ({o['off']['q1_ms']:.0f}–{o['off']['q3_ms']:.0f}) "
        "| 1.00× |",
        f"| debugger on, breakpoint: execute request to both ranks' `stopped` events | {o['to_stopped']['median_ms']:.0f} ms "
        f"({o['to_stopped']['q1_ms']:.0f}–{o['to_stopped']['q3_ms']:.0f}) | {o['to_stopped']['median_ms'] / off:.2f}× |",
        f"| the same, continued at once (JupyterLab's Continue, all ranks): to idle | {o['stopped_full']['median_ms']:.0f} ms "
        f"({o['stopped_full']['q1_ms']:.0f}–{o['stopped_full']['q3_ms']:.0f}) | {o['stopped_full']['median_ms'] / off:.2f}× |",
        f"| debugger on, no breakpoint in the cell: to idle | {o['on_no_breakpoint']['median_ms']:.0f} ms "
        f"({o['on_no_breakpoint']['q1_ms']:.0f}–{o['on_no_breakpoint']['q3_ms']:.0f}) | "
        f"{o['on_no_breakpoint']['median_ms'] / off:.2f}× |",
        "",
        f"Each rank a one-shot cell forks while the debugger is on is a debugpy session of its own (it connects to "
        f"the kernel's debugpy adapter at its cell, nbddp's router attaches it and gives it the breakpoints): that is "
        f"what attaching costs a one-shot cell. Load average at the end of the run: {', '.join(str(x) for x in r['load'])} (2 cores).",
        *(["", r["note"]] if r.get("note") else []),  # what was measured besides, to read this run by
    ]) + "\n"


if __name__ == "__main__":
    import json

    print(json.dumps(measure("--quick" in sys.argv), indent=1))
