"""In a pool's rank on NCCL: an interrupt that finds the rank stuck in a collective aborts its communicators.

The kernel's interrupt (SIGUSR2, ``server.INTERRUPT``) raises KeyboardInterrupt in a running command, but only
once the main thread is back in Python. A rank that waits on an NCCL collective whose peer is gone (or never
came) waits inside CUDA (a stream synchronisation, ``.item()``), where no Python handler runs. gloo's waiters
are freed by their peers closing their sockets; NCCL's are not. So a thread of its own hears the same signal
(the wakeup descriptor CPython's C-level handler writes the signal's number to, whatever the main thread is
doing), and if the same command still runs ``ABORT_AFTER_S`` later, aborts every NCCL communicator of the
rank (torch's ``_abort_process_group``): NCCL's kernels see the abort flag and end, the wait returns, and the
pending KeyboardInterrupt (or NCCL's error) ends the command. The group is then gone, as gloo's is after a
peer left, and the kernel's ``Regroup`` makes a new one (``usergroup.regroup``).
"""
from __future__ import annotations

import os
import signal
import threading
import time

ABORT_AFTER_S = 1.0  # the main thread's own KeyboardInterrupt first: a rank running Python ends without an abort


def install(busy: list, interrupt: int, abort=None) -> threading.Thread | None:
    """Watch for ``interrupt`` while ``busy`` holds the running command's token (the server's list: one
    object per command, empty between commands). ``abort``: what frees the rank (``abort_groups``)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: no handler runs here, nothing to watch for
        os.close(read)
        os.close(write)
        return None
    thread = threading.Thread(target=_watch, args=(read, busy, interrupt, abort or abort_groups),
                              name="nbddp-nccl-abort", daemon=True)
    thread.start()
    return thread


def _watch(read: int, busy: list, interrupt: int, abort) -> None:
    while True:
        try:
            got = os.read(read, 64)
        except OSError:
            return
        if not got:
            return
        if interrupt not in got:
            continue
        token = _token(busy)
        if token is None:
            continue
        deadline = time.monotonic() + ABORT_AFTER_S
        while _token(busy) is token and time.monotonic() < deadline:
            time.sleep(0.02)
        if _token(busy) is token:
            abort()


def _token(busy: list):
    try:
        return busy[0]
    except IndexError:  # (cleared by the main thread meanwhile)
        return None


def abort_groups() -> None:
    """Every NCCL communicator of this rank aborted, the default group's object kept for ``usergroup.regroup``
    to say what was bound to it. Nothing where the rank has no group (or not on NCCL)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from . import usergroup

    if not dist.is_initialized() or not usergroup.on_nccl():
        return
    usergroup.aborted(c10d._get_default_group())
    c10d._abort_process_group()
