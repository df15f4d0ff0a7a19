"""The OpenMP fork hazard, made safe for ``--threads N > 1``.

GNU OpenMP (libgomp, torch's CPU thread runtime on Linux) keeps the worker threads of the kernel's first
parallel op alive. A fork inherits the pool's bookkeeping but not its threads, so a rank's first parallel
op with more than one thread waits for them forever. With one thread (nbddp's default) a rank never
enters a parallel region. For more, the kernel releases its pool just before it forks (OpenMP 5.0's
``omp_pause_resource_all``: the idle threads end; the kernel's next parallel op starts new ones, about
0.1 ms), so the ranks inherit no pool to wait on. Where that cannot be done the launch is refused.
"""
from __future__ import annotations

import ctypes
import os

from ..errors import UsageError

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings


def loaded_gomp() -> list[str]:
    """Paths of the libgomp copies mapped into this process (torch ships its own)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:  # no /proc (macOS): torch's libomp re-initialises itself after a fork
        return []
    return sorted(p for p in paths if os.path.isabs(p))


def release_threads(threads: int) -> None:
    """Before forking ranks that will run ``threads`` OpenMP threads: make their first parallel op safe."""
    if threads <= 1:
        return  # a rank with one thread never starts a parallel region: nothing to release
    for path in loaded_gomp():
        why = _pause(path)
        if why:
            raise UsageError(
                f"--threads {threads}: this kernel's OpenMP runtime ({path}) cannot release its worker "
                f"threads ({why}), and a forked rank that runs a parallel op with more than one thread "
                "after the kernel ran one hangs forever.\n"
                "Use --threads 1 (the default), or --start-method spawn (fresh interpreters), or restart "
                "the kernel and run this cell before any torch op in the notebook."
            )


def _pause(path: str) -> str | None:
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle, nothing new mapped
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        return "it has no omp_pause_resource_all: an OpenMP runtime older than 5.0"
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return None if pause(OMP_PAUSE_SOFT) == 0 else "omp_pause_resource_all failed"
