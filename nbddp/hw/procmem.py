"""Process memory as /proc tells it, read from outside the process or from inside: resident bytes, private
bytes (USS: what the process copied or allocated, not shared with the kernel it forked from), page faults.
The dashboard samples ranks with it (views/monitor.py) and a rank measures a cell's copy-on-read with it
(rank/copywatch.py). Where there is no ``smaps_rollup`` (Linux < 4.14, other systems), psutil answers.
"""
from __future__ import annotations

import os

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PROC = os.path.isdir("/proc/self") and os.path.exists("/proc/self/smaps_rollup")  # Linux >= 4.14
PRIVATE = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")  # psutil's USS, from smaps_rollup


class Gone(Exception):
    """The process has exited (a zombie until its parent reaps it) or is gone."""


def rss_of(pid: int) -> int:
    """Resident bytes of a live process (a zombie's are none: it has exited)."""
    if not PROC:
        return _psutil(pid, lambda p: p.memory_info().rss)
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            resident = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        raise Gone(pid) from None
    if resident == 0:  # a zombie's statm is all zeros: it has exited
        raise Gone(pid)
    return resident * PAGE


def faults_of(pid: int) -> int:
    """Page faults the process has taken (minor and major): each maps a page it touched anew."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[7]) + int(fields[9])  # minflt, majflt (the stat file's fields 10 and 12)
    except (OSError, IndexError, ValueError):
        raise Gone(pid) from None


def uss_of(pid: int) -> int:
    """Bytes only this process holds (private clean + dirty + huge pages), as psutil's ``uss``."""
    if not PROC:
        return _psutil(pid, lambda p: p.memory_full_info().uss)
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:
        raise Gone(pid) from None
    total = 0
    for line in text.splitlines():
        if line.startswith(PRIVATE):
            total += int(line.split()[1]) * 1024
    return total


def _psutil(pid: int, read):
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise Gone(pid)
        return read(proc)
    except psutil.Error:
        raise Gone(pid) from None
