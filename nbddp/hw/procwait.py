"""Is a process blocked in native code? As /proc tells it from outside: its main thread asleep on a futex (a
lock or condition variable of C or C++ code: gloo waiting for a peer, DDP's reducer waiting for its
all_reduce), and between two looks neither it nor the process ran.

A main thread in Python never waits on a futex out of reach: Python's own locks and sleeps return to the
interpreter on a signal, and a rank waiting for its next command reads a pipe. So a rank that failed to answer
an interrupt and is seen blocked this way is held in a collective, and so is one the kernel waits for after a
peer failed (kernel/cells/grace.py). Where /proc does not tell (another system, a kernel that hides
``wchan``), a process is never said to be blocked: the caller keeps its whole grace.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10_000_000
IDLE_TICKS = 2  # the process's threads together may run this many clock ticks (TICK_NS each) between two looks
MIN_GAP_S = 0.05  # two looks closer than this tell nothing (a node's agent may answer two asks at once)


@dataclass(frozen=True)
class Look:
    on_futex: bool  # the main thread sleeps on a futex (``S`` state, ``wchan`` futex_*)
    main_ns: int  # the main thread's time on a CPU (schedstat; clock ticks where there is none)
    ticks: int  # the process's time on a CPU, every thread (user + system clock ticks)
    at: float  # when it was taken (time.monotonic of the machine that looked)


def look(pid: int) -> Look | None:
    """The process as it is now; None if it is gone or /proc does not tell."""
    task = f"/proc/{pid}/task/{pid}"
    try:
        state, main_ticks = _stat(f"{task}/stat")
        with open(f"{task}/wchan") as f:
            wchan = f.read()
        _, ticks = _stat(f"/proc/{pid}/stat")
        main_ns = _schedstat(f"{task}/schedstat")
    except (OSError, ValueError, IndexError):
        return None
    return Look(state == "S" and wchan.startswith("futex"), main_ticks * TICK_NS if main_ns is None else main_ns,
                ticks, time.monotonic())


def blocked(before: Look | None, after: Look | None) -> bool:
    """Blocked from one look to the next (``MIN_GAP_S`` apart at least): asleep on a futex at both, the main
    thread never on a CPU between them (a signal's C handler aside: under a millisecond), the whole process
    nearly idle."""
    return (before is not None and after is not None and after.at - before.at >= MIN_GAP_S
            and before.on_futex and after.on_futex
            and after.main_ns - before.main_ns < 1_000_000 and after.ticks - before.ticks <= IDLE_TICKS)


def _stat(path: str) -> tuple[str, int]:
    """(state, user + system clock ticks) from a ``stat`` file (the name in parentheses may hold spaces)."""
    with open(path) as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[11]) + int(fields[12])


def _schedstat(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
