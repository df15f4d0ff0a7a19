"""What must hold before ranks are forked (one-shot cell, pool, Python API), checked before anything
changes: bad options, a launch from inside a rank or during another launch, the CUDA guard."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import textwrap

from ..errors import UsageError
from ..hw import cuda
from . import devices, options
from .ranks import keeping

_launching = False  # one launch at a time per process


def launching() -> bool:
    return _launching


@contextlib.contextmanager
def one_at_a_time():
    """While ranks of a one-shot cell run, or a pool starts: a second launch is refused."""
    global _launching
    _launching = True
    try:
        yield
    finally:
        _launching = False


def preflight(config, *, pool: bool = False, queued: bool = False) -> devices.Plan:
    """Everything that can refuse a launch, with nothing changed yet; returns the plan (its notes said).
    ``queued``: a background cell, which runs after the launch running now (the background queue's order)."""
    refusals(config, pool=pool, queued=queued)
    plan = devices.plan(config.devices, config.accelerator, config.backend)
    method = "fork" if config.start_method == "auto" else config.start_method
    held = plan.accelerator == "cuda" and method == "fork" and cuda.backend().refusal()
    if held and config.start_method == "auto":
        method = "forkserver"  # a fork of this kernel could not use a GPU
        plan = dataclasses.replace(plan, notes=(*plan.notes, *_forkserver_note(held)))
    for note in [*plan.notes, *_oversubscribed(plan, config.threads)]:  # busy GPUs auto skipped, many CPU ranks
        print(note, file=sys.stderr)
    if held and method == "fork":  # asked for by name: the notebook's data copy-on-write, or nothing
        raise held
    why = options.keep_asked(config) and keeping.unkeepable(config.cluster, method)
    if why:
        fix = "drop --keep, or --start-method fork" if config.start_method != "auto" else \
            "drop --keep, or restart the kernel and start the pool before anything touches CUDA"
        raise UsageError(f"--keep {config.keep}: only a pool forked from the kernel is kept across its end for now, "
                         f"not {why}. Nothing started: {fix}.")
    return dataclasses.replace(plan, start_method=method)


_said_forkserver = False


def _forkserver_note(held) -> list[str]:
    """Once per kernel: the ranks start from the forkserver, and why (who made the kernel's CUDA context)."""
    global _said_forkserver
    if _said_forkserver:
        return []
    _said_forkserver = True
    why = str(held).splitlines()[0].rstrip(".")
    return [textwrap.fill(f"nbddp: {why}, so a fork of it cannot use a GPU: the ranks start from nbddp's forkserver "
                          "instead (no restart; the notebook values a cell reads are sent, tensors through shared "
                          "memory).", width=NOTE_WIDTH, break_long_words=False, break_on_hyphens=False)]


def refusals(config, *, pool: bool = False, queued: bool = False) -> None:
    """What refuses a launch whatever the devices' state: bad options (the device spec included), a launch
    from inside a rank or during another, a spawned pool. ``%ddp restart`` checks this before it stops the
    running pool, and plans the devices after (the old pool's GPUs are free by then)."""
    if os.environ.get("NBDDP_RANK") is not None:
        raise UsageError(
            "nbddp cannot launch from inside a rank (nested %%ddp / launch).\n"
            "The cell already runs on every rank: call the code directly."
        )
    if _launching and not queued:
        raise UsageError("another nbddp launch is still running in this process; wait for it to finish.")
    if pool and config.start_method == "spawn":
        raise UsageError("--start-method spawn: a pool forks its ranks (from the kernel, or from nbddp's "
                         "forkserver) and never spawns them; spawn works for one-shot %%ddp cells only.\nNothing ran: "
                         "drop --start-method from %ddp start (or use forkserver), or %ddp stop and run the cell "
                         "one-shot with it.")
    options.check(config)
    if config.cluster and not pool or config.nodes > 1 and not config.cluster:
        raise UsageError("--cluster and --nodes start a pool across the nodes of a Ray cluster: %ddp start "
                         "--cluster ray --nodes N --devices D (then %%ddp cells run on it). Nothing ran.")
    if options.keep_asked(config) and not pool:
        raise UsageError(f"--keep {config.keep}: a pool is kept across its kernel's end; a one-shot cell's ranks end "
                         "with it. %ddp start --keep DURATION starts such a pool. Nothing ran.")
    why = options.keep_asked(config) and keeping.unkeepable(config.cluster)
    if why:
        raise UsageError(f"--keep {config.keep}: not for {why} (its ranks could not be handed to the next kernel). "
                         "Nothing started: drop --keep.")
    devices.parse_devices(config.devices)


_warned_oversubscribed: set = set()
NOTE_WIDTH = 88  # a note's lines: a notebook's text output wraps a longer line wherever it must, mid-word too


def _oversubscribed(plan: devices.Plan, threads: int) -> list[str]:
    """Many more CPU ranks than cores: said once per kernel and world size (it runs, slowly)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = plan.world_size * threads
    if plan.accelerator != "cpu" or want <= cores or (plan.world_size, threads) in _warned_oversubscribed:
        return []
    _warned_oversubscribed.add((plan.world_size, threads))
    per = f" x {threads} threads" if threads > 1 else ""
    note = (f"nbddp: {plan.world_size} CPU ranks{per} on {cores} cores: they take turns on the cores and every "
            f"collective waits for the slowest, so steps run far slower than on {max(1, cores // threads)} rank(s). "
            "Fine for trying code at this world size; interrupt and --timeout still stop every rank.")
    return [textwrap.fill(note, width=NOTE_WIDTH, break_long_words=False, break_on_hyphens=False)]
