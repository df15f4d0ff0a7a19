"""Background cells (issue 41), measured from a client as a user's front end sees them, in one kernel per run:

- a trivial pool cell (one gloo all_reduce) sent with ``--bg``: from the request to its final line in its
  cell (``· ok``), against the same cell blocking (request to idle), interleaved; and how soon the notebook
  is free again (the ``--bg`` cell's reply);
- the kernel's CPU while it is idle and a background cell streams 10,000 lines/s (two ranks, 5,000 each),
  against the idle kernel and the same stream in a blocking cell (the anchors), and the lines that arrived.

python benchmarks/run.py --only background
"""
from __future__ import annotations

import re
import statistics
import time

import kernel_code as kc
from kernel import Kernel

TRIVIAL = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)"
STREAM = """%%ddp {bg}
import time
t0, n = time.monotonic(), 0
while time.monotonic() - t0 < {secs}:
    due = int((time.monotonic() - t0) * {rate})
    while n < due:
        print(f'rank {{rank}} step {{n}} loss 0.{{n:06d}}')
        n += 1
    time.sleep(0.005)
print('streamed', n, flush=True)"""
RATE_PER_RANK = 5_000
STREAM_S, WINDOW_S = 12.0, 6.0  # the stream's length, and the window measured in its middle


def _final(res) -> bool:
    return any(re.search(r"· (ok|failed|interrupted)", d.get("data", {}).get("text/plain", "")) for d in res.displays)


def _cpu(k: Kernel, seconds: float) -> float:
    """The kernel process's own CPU (its threads, not its ranks) over ``seconds``, as a fraction of a core."""
    p = k.process()
    c0, t0 = p.cpu_times(), time.monotonic()
    time.sleep(seconds)  # (a measuring window: nothing waits on it)
    c1 = p.cpu_times()
    return (c1.user + c1.system - c0.user - c0.system) / (time.monotonic() - t0)


def round_trips(k: Kernel, n: int) -> dict:
    blocking, background, free = [], [], []
    for i in range(n):
        for kind in (("bg", "blocking") if i % 2 else ("blocking", "bg")):
            t0 = time.perf_counter()
            if kind == "blocking":
                k.ok(f"%%ddp\n{TRIVIAL}")
                blocking.append(time.perf_counter() - t0)
                continue
            msg_id = k.execute(f"%%ddp --bg\n{TRIVIAL}")
            sent = k.collect(msg_id, timeout=60)
            free.append(time.perf_counter() - t0)
            if not _final(sent):  # (a quick cell's line can end before its reply)
                k.follow(msg_id, _final, timeout=60)
            background.append(time.perf_counter() - t0)
    med = statistics.median
    return {"cells": n, "blocking_ms": med(blocking) * 1e3, "bg_ms": med(background) * 1e3,
            "bg_free_ms": med(free) * 1e3, "ratio": med(background) / med(blocking)}


def streaming(k: Kernel) -> dict:
    idle = _cpu(k, 3.0)
    out = {"idle_cpu": idle, "rate": 2 * RATE_PER_RANK}
    for kind in ("bg", "blocking"):
        code = STREAM.format(bg="--bg" if kind == "bg" else "", secs=STREAM_S, rate=RATE_PER_RANK)
        msg_id = k.execute(code)
        if kind == "bg":
            sent = k.collect(msg_id, timeout=60)
            time.sleep((STREAM_S - WINDOW_S) / 2)  # into the stream's middle (nothing waits on it)
            out["bg_cpu"] = _cpu(k, WINDOW_S)
            got = k.follow(msg_id, lambda r: "streamed" in r.stdout and _final(r), timeout=120)
            out["bg_lines"] = (sent.stdout + got.stdout).count("\n")
        else:
            time.sleep((STREAM_S - WINDOW_S) / 2)
            out["blocking_cpu"] = _cpu(k, WINDOW_S)  # (the client reads its messages after: they queue)
            res = k.collect(msg_id, timeout=120)
            out["blocking_lines"] = res.stdout.count("\n")
    return out


def measure(quick: bool) -> dict:
    k = Kernel(env={"GLOO_SOCKET_IFNAME": "lo"})
    try:
        k.ok(kc.SETUP)
        k.ok("%ddp start --devices 2")
        k.ok(f"%%ddp\n{TRIVIAL}")  # warm
        trips = round_trips(k, 10 if quick else 40)
        stream = streaming(k)
        k.ok("%ddp stop")
    finally:
        k.shutdown()
    return {"round_trip": trips, "streaming": stream}


def render(r: dict) -> str:
    t, s = r["round_trip"], r["streaming"]
    return "\n".join([
        "## 11. Background cells (issue 41)",
        "",
        f"A trivial pool cell (one gloo all_reduce, 2 ranks), from the request to its end as a client sees it, "
        f"median of {t['cells']} each, interleaved in one kernel: blocking (request to idle) against `--bg` "
        "(request to its final line in its own cell).",
        "",
        "| cell | round trip | × blocking |",
        "|---|---|---|",
        f"| blocking `%%ddp` | {t['blocking_ms']:.1f} ms | 1.00× |",
        f"| `%%ddp --bg`, to its final line | {t['bg_ms']:.1f} ms | {t['ratio']:.2f}× |",
        f"| `%%ddp --bg`, to its reply (the notebook free again) | {t['bg_free_ms']:.1f} ms | "
        f"{t['bg_free_ms'] / t['blocking_ms']:.2f}× |",
        "",
        f"Target ≤ 1.2×: {t['ratio']:.2f}× — {'met' if t['ratio'] <= 1.2 else 'MISSED'}. (At CPython's 5 ms thread "
        "switch interval the background thread held the interpreter lock while the notebook's thread sent the "
        "reply: 1.5×; background.py lowers it to 0.5 ms while a background cell runs.)",
        "",
        f"The kernel's own CPU (its threads, not the ranks'), {WINDOW_S:g} s in the middle of a {STREAM_S:g} s stream "
        f"of {s['rate']:,} lines/s (2 ranks × {RATE_PER_RANK:,}, each line its own):",
        "",
        "| kernel | CPU (fraction of a core) | lines that reached the client |",
        "|---|---|---|",
        f"| idle, nothing running (anchor) | {s['idle_cpu']:.1%} | |",
        f"| idle, a `--bg` cell streaming | {s['bg_cpu']:.1%} | {s['bg_lines']:,} |",
        f"| a blocking cell streaming (anchor) | {s['blocking_cpu']:.1%} | {s['blocking_lines']:,} |",
        "",
        f"Target < 5 % of a core: {s['bg_cpu']:.1%} — {'met' if s['bg_cpu'] < 0.05 else 'MISSED'}.",
    ]) + "\n"


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(measure("--quick" in sys.argv), indent=1))
