"""Is a process waiting, using no CPU? As /proc tells it from outside: its main thread asleep on a futex (a
lock or condition variable: gloo waiting for a peer, DDP's reducer waiting for its all_reduce, but also a
Python ``thread.join()`` or ``queue.get()``), and between two looks neither the main thread, nor the process's
other threads, nor its children (DataLoader workers, a process pool) ran.

A rank waiting for its next command reads a pipe, and one sleeping or reading a file or socket is not on a
futex: none of them is said to be blocked. One the kernel waits for after a peer failed, seen blocked, waits
for that peer (or for nothing that uses a CPU): kernel/cells/grace.py interrupts it at once. After the
interrupt, one still blocked is held in native code (a collective) unless its Python handler ran (the rank's
``Heard``): that the kernel learns from the rank, not from here. Where /proc does not tell (another system,
a kernel that hides ``wchan``: ``tells()``), a process is never said to be blocked: the caller keeps its whole
grace.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass

from .. import timeline

TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10_000_000
IDLE_TICKS = 2  # the process and its children may run this many clock ticks (TICK_NS each) between two looks


@dataclass(frozen=True)
class Look:
    on_futex: bool  # the main thread sleeps on a futex (``S`` state, ``wchan`` futex_*)
    main_ns: int  # the main thread's time on a CPU (schedstat; clock ticks where there is none)
    ticks: int  # the process's time on a CPU, every thread, and its live children's (user + system clock ticks)
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
        ticks += sum(_children_ticks(pid))
    except (OSError, ValueError, IndexError):
        return None
    return Look(state == "S" and wchan.startswith("futex"), main_ticks * TICK_NS if main_ns is None else main_ns,
                ticks, time.monotonic())


def blocked(before: Look | None, after: Look | None) -> bool:
    """Blocked from one look to the next (``MIN_GAP_S`` apart at least): asleep on a futex at both, the main
    thread never on a CPU between them (a signal's C handler aside: under a millisecond), its other threads and
    its live children nearly idle."""
    return (before is not None and after is not None and after.at - before.at >= timeline.MIN_GAP_S
            and before.on_futex and after.on_futex
            and after.main_ns - before.main_ns < 1_000_000 and after.ticks - before.ticks <= IDLE_TICKS)


@functools.lru_cache(maxsize=None)
def tells() -> bool:
    """Whether /proc tells here: a thread of this process waiting on an Event is seen asleep on a futex."""
    waiting, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (ready.set(), waiting.wait()), daemon=True)
    thread.start()
    ready.wait()
    try:
        for _ in range(100):  # (it may not sleep yet)
            try:
                with open(f"/proc/{os.getpid()}/task/{thread.native_id}/wchan") as f:
                    if f.read().startswith("futex"):
                        return True
            except OSError:
                return False
            time.sleep(0.01)
        return False
    finally:
        waiting.set()
        thread.join()


def _children_ticks(pid: int):
    """Each live child's clock ticks (a child of any thread of the process; one gone meanwhile: none)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = f.read().split()
        except OSError:
            continue
        for child in children:
            try:
                yield _stat(f"/proc/{child}/stat")[1]
            except (OSError, ValueError, IndexError):
                continue


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
