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
import sys
import threading
import time

from .. import timeline


class InterruptWatch:
    """The thread that frees a rank stuck in a collective. ``busy``: the server's list, one token per command
    (empty between commands); ``heard()`` is called by the server's own handler of ``interrupt`` each time it
    runs, that is each time the main thread got back to Python: then nothing is aborted (a cell that catches
    the KeyboardInterrupt and saves a checkpoint with collectives keeps its group). ``abort``: what frees the
    rank (``abort_groups``)."""

    def __init__(self, busy: list, interrupt: int, abort=None):
        self.busy, self.interrupt, self.abort = busy, interrupt, abort or abort_groups
        self.handled = 0  # times the main thread ran the interrupt's handler
        self.received = 0  # times the interrupt arrived (one byte each on the wakeup descriptor)
        self.read, self.write = os.pipe()
        os.set_blocking(self.write, False)
        self.thread = threading.Thread(target=self._watch, name="nbddp-nccl-abort", daemon=True)

    def start(self) -> InterruptWatch | None:
        """Started, or None where this is not the main thread (no handler runs here: nothing to watch for)."""
        if not self.rearm():
            os.close(self.read)
            os.close(self.write)
            return None
        self.thread.start()
        return self

    def rearm(self) -> bool:
        """The wakeup descriptor set again (before each command): a cell's asyncio loop with signal handlers
        takes it over, and sets none once it closes."""
        try:
            signal.set_wakeup_fd(self.write, warn_on_full_buffer=False)
        except ValueError:
            return False
        return True

    def heard(self) -> None:
        self.handled += 1

    def _watch(self) -> None:
        while True:
            try:
                got = os.read(self.read, 64)
            except OSError:
                return
            if not got:
                return
            self.received += got.count(self.interrupt)
            token = _token(self.busy)
            if token is None or self.handled >= self.received:
                continue
            deadline = time.monotonic() + timeline.ABORT_AFTER_S
            while _token(self.busy) is token and self.handled < self.received and time.monotonic() < deadline:
                time.sleep(0.02)
            if _token(self.busy) is token and self.handled < self.received:  # never back in Python since
                try:
                    self.abort()
                except Exception as e:  # noqa: BLE001 - the watch goes on; the kernel's deadline ends the pool
                    print(f"nbddp: aborting the rank's NCCL communicators failed: {e!r}", file=sys.stderr)


def install(busy: list, interrupt: int, abort=None) -> InterruptWatch | None:
    """A started ``InterruptWatch`` (None where this is not the main thread)."""
    return InterruptWatch(busy, interrupt, abort).start()


def _token(busy: list):
    try:
        return busy[0]
    except IndexError:  # (cleared by the main thread meanwhile)
        return None


def abort_groups() -> None:
    """Every NCCL communicator of this rank aborted; the groups' objects kept until the rank is idle (a gloo
    subgroup freed now can deadlock, usergroup.py), the default one for ``usergroup.regroup`` to say what was
    bound to it. Nothing where the rank has no group (or not on NCCL)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from . import usergroup

    if not dist.is_initialized() or not usergroup.on_nccl():
        return
    usergroup.aborted(c10d._get_default_group(), list(c10d._world.pg_map))
    c10d._abort_process_group()
