"""What a real cell's first steps import lazily, imported once in the kernel before ranks are forked, so a
fresh rank starts at full speed instead of importing ~800 modules in its first step.

``DistributedDataParallel(model)`` imports ``torch._dynamo`` (sympy, mpmath, ... 819 modules) the first time
it runs in a process; a fresh forked rank paid 6-7 s for it in its first step, in every one-shot cell and
in a pool's first. Imported once in the kernel (0.7-3.4 s, ~70 MiB), every fork shares it. The kernel
imports them on a thread of its own, started by ``%load_ext`` (which stays as fast as before), and every
fork waits for that thread first (``wait``): nothing of nbddp's runs and no import lock is held while
the kernel forks. Modules a rank imported that the kernel had not are imported just before the next fork
(``learn``), but only submodules of packages the kernel has already imported: warming never brings a new
library into the kernel. ``NBDDP_WARM=0`` (before ``%load_ext``) turns it off. Where a pool kept from the
notebook waits at ``%load_ext`` (``defer``), nothing is imported then, torch neither: the first fork starts the
thread, with torch's import first, and waits for it.
None of this touches CUDA: ``import torch._dynamo`` initialises no device.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings

from ...hw import driverwatch
from ..debugger.dap import untraced

# Measured, not guessed (benchmarks/bench_firststep.py lists what a fresh rank imports in its first real
# steps, torch 2.13): DDP's constructor (torch._dynamo and what it pulls), AdamW's first step
# (torch.profiler's monitor), FSDP2's fully_shard, Join, and a DataLoader with workers and a
# DistributedSampler (multiprocessing's fork machinery). autocast, GradScaler, SGD and the LR schedulers
# import nothing new.
WARM_IMPORTS = (
    "torch._dynamo",
    "torch.nn.parallel.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.algorithms.join",
    "torch.profiler._cupti_monitor",
    "torch.utils.data",
    "multiprocessing.popen_fork",
    "multiprocessing.queues",
    "multiprocessing.synchronize",
)

# Never learned: what may start compile workers or touch a device when imported.
NEVER = ("__main__", "torch.cuda", "torch._inductor", "triton", "torch.compiler", "nbddp")

def enabled() -> bool:
    return os.environ.get("NBDDP_WARM", "1") not in ("0", "off", "false", "no")


class Warming:
    """The kernel's warming, in one object: its thread, the fork hook, what ranks imported since."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.hooked = False  # os.register_at_fork(before=self.join) done (once a process: it cannot be undone)
        self.learned: list[str] = []  # modules ranks imported, for the next fork
        self.tried: set[str] = set()  # each name imported (or failed) once: a failure is not retried at every cell
        self.deferred = False  # nothing imported at %load_ext (a kept pool waited for it): the first fork does it

    def start(self, torch_first: bool = False) -> None:
        """``torch_first``: torch's import too, first (``worker.warm_start``: a deferred load's)."""
        self.deferred = False
        names = [n for n in WARM_IMPORTS if n not in sys.modules] if enabled() else []
        if (names or torch_first) and self.thread is None:
            # untraced by the kernel's debugger (JupyterLab's panel, often turned on right after %load_ext): under
            # pydevd's tracer these ~800 imports took 7.5 s instead of 1.3 on 2 cores, and the first %%ddp cell
            # waits for them before it forks (``wait``), on --timeout's clock: a 6 s one passed with rank 0 forked
            # and rank 1 not, rank 0 waited at the rendezvous, no rank reached the cell's breakpoint
            self.thread = untraced(threading.Thread(target=_import_all, args=(names, torch_first),
                                                    name=driverwatch.WARM_THREAD, daemon=True))
            self.thread.start()
            self.hook_forks()

    def hook_forks(self) -> None:
        """Any fork in the kernel waits for the warming thread, not only nbddp's: the notebook's own
        ``torch.multiprocessing`` start with fork, Lightning's ``ddp_notebook``, Accelerate's
        ``notebook_launcher`` would otherwise copy a module lock the thread holds, and their child hang on its
        first import of that module (measured: a raw fork's first all_reduce right after %load_ext)."""
        if not self.hooked:
            self.hooked = True
            os.register_at_fork(before=self.join)

    def defer(self) -> None:
        """``%load_ext`` in a kernel that may only take a kept pool (one kept from its notebook waits): ``%ddp attach``
        and the pool's cells need no torch in the kernel (its ranks have it), so nothing is imported now, torch
        neither (1-2 s of a restart's way back to the pool). The first fork of ranks waits for it all (``wait``:
        torch's import, then the warm ones, on the warming thread). No forkserver template is made: a GPU pool this
        kernel starts later (one holding CUDA) starts a fresh server."""
        self.deferred = True

    def join(self) -> None:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait(self) -> None:
        if self.deferred:  # (untraced, on the warming thread as at load; an interrupt stops the wait, not them)
            self.start(torch_first=True)
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.learned and enabled():
            names = list(dict.fromkeys(self.learned))
            self.learned.clear()
            self.tried.update(names)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _import_all(names)

    def learn(self, imported) -> None:
        self.learned.extend(n for n in imported if n not in sys.modules and n.partition(".")[0] in sys.modules
                            and not n.startswith(NEVER) and n not in self.tried)


WARMING = Warming()  # the kernel's


def defer() -> None:
    """Nothing imported until the first fork (``Warming.defer``)."""
    WARMING.defer()


def start() -> None:
    """Import ``WARM_IMPORTS`` in the kernel, on a thread of its own (returns at once)."""
    WARMING.start()


def wait() -> None:
    """Before a fork: the warming thread has finished (a fork while it imports would copy a held import
    lock into the rank); what ranks imported since the last fork is imported here, on this thread."""
    WARMING.wait()


def learn(imported) -> None:
    """Modules a rank imported that the kernel lacks, imported before the next fork (``wait``, on the
    main thread, their warnings silenced: no output reaches a cell from here): submodules of packages
    the kernel has already imported, never a new library, never one that may touch a device."""
    WARMING.learn(imported)


def _import_all(names, torch_first: bool = False) -> None:
    """``names`` imported; ``torch_first``: what ``worker.warm_start`` imports and makes, first."""
    from ...rank import worker

    for name in [*worker.RANK_IMPORTS, *names] if torch_first else names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module the kernel cannot import stays the rank's to import
            pass
    if torch_first and "torch" in sys.modules:
        from ...rank.pipestore import store_class

        store_class()  # (the process group's store class, made once here)
