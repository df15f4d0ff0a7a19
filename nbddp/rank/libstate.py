"""Distributed state that libraries resolve once and cache, made the rank's own, as under torchrun.

A library that reads its world size and rank when an object is made, or when it is imported, keeps the
kernel's answer in a fork (world size 1, rank 0), and a notebook object sent to a pool by pickle carries
the same copy. So in every rank, before the cell:
- accelerate's singletons (``PartialState``, ``AcceleratorState``, ``GradientState``) are reset and, where
  the notebook had made them, made again in the rank with the notebook's settings (cpu, mixed precision,
  dynamo plugin, gradient accumulation); objects that share them (an ``Accelerator`` made in the notebook)
  then see the rank's state;
- a transformers ``TrainingArguments`` forgets its cached device (``_setup_devices``), ``_n_gpu`` and
  ``distributed_state`` and resolves them again in the rank (a ``Trainer``'s ``args`` too, though the
  ``Trainer`` itself is then named below: it fixed its DDP settings when made);
- Lightning's and TorchMetrics' ``rank_zero_only.rank`` (read from the environment at import) become the
  rank's.
A notebook object that still disagrees with the cell's world size (a Lightning ``Fabric`` or ``Trainer``
made in the notebook, say) is named on rank 0's stderr with what to do instead (``stale_message``), once,
when a cell reads it.
"""
from __future__ import annotations

import ast
import sys

from ..ipy.cellcode import names_bound

# key -> (module, class): what this module knows how to fix, or at least to check
CLASSES = {
    "partial": ("accelerate.state", "PartialState"),
    "accelerator_state": ("accelerate.state", "AcceleratorState"),
    "gradient": ("accelerate.state", "GradientState"),
    "accelerator": ("accelerate.accelerator", "Accelerator"),
    "training_args": ("transformers.training_args", "TrainingArguments"),
    "hf_trainer": ("transformers.trainer", "Trainer"),
    "fabric": ("lightning_fabric.fabric", "Fabric"),
    "pl_trainer": ("pytorch_lightning.trainer.trainer", "Trainer"),
}


# the modules whose state is the rank's to fix; a rank that has none of them imported does nothing
WATCHED = (*sorted({module for module, _ in CLASSES.values()}), "lightning_utilities.core.rank_zero",
           "torchmetrics.utilities.prints")


_stale: dict[str, tuple[int, str]] = {}  # name -> (id of the object, what to say when a cell reads it): once


def after_fork(ns: dict, ctx) -> None:
    """In a forked rank, before its first cell: the process-wide caches, then the notebook's objects."""
    if not any(m in sys.modules for m in WATCHED):
        return
    _rank_zero(ctx.rank, ctx.local_rank)
    _stale.update(_fix(ns, list(ns), ctx, reset=True))


def before_cell(ns: dict, cmd, ctx) -> None:
    """A cell's notebook values just unpickled (a pool's or a spawned rank) are made the rank's own; a
    stale object the cell reads is named (rank 0)."""
    if cmd.updates and any(m in sys.modules for m in WATCHED):
        for name in cmd.updates:
            _stale.pop(name, None)
        _stale.update(_fix(ns, cmd.updates, ctx, reset=False))
    if _stale:
        for name in sorted(_read_by(cmd.source) & set(_stale)):
            kept, message = _stale.pop(name)
            if ctx.rank == 0 and id(ns.get(name)) == kept:  # (a pool's cell may have made its own since)
                print(message, file=sys.stderr, flush=True)


def _read_by(source: str) -> set[str]:
    """The names a cell reads and does not bind itself (one it makes in the cell is the rank's own)."""
    try:
        return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)} - names_bound(source)
    except SyntaxError:
        return set()


def stale_message(name: str, kind: str, seen: int, world_size: int) -> str:
    return (f"nbddp: `{name}` ({kind} made in the notebook) has world size {seen}, but this cell runs on "
            f"{world_size} ranks, and nbddp cannot make it the rank's own: make it inside the %%ddp cell "
            "(each rank then makes its own, as under torchrun).")


# -- accelerate's singletons ---------------------------------------------------------------------
def _snapshot(reset: bool) -> tuple:
    """The singletons' settings as they are (the notebook's, after a fork), then, with ``reset``, none."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None, {}, {}, {}
    kept = tuple(dict(cls._shared_state) for cls in (state.PartialState, state.AcceleratorState, state.GradientState))
    if reset:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    return (state, *kept)


def _restore_accelerate(state, partial: dict, accelerator: dict, gradient: dict) -> None:
    """Make again, in the rank, the singletons the notebook had made, with the notebook's settings; the
    objects made in the notebook share their dicts (``__dict__ = _shared_state``), so they follow."""
    if state is None:
        return
    if partial and not state.PartialState._shared_state:
        state.PartialState(cpu=partial.get("_cpu", False))
    if accelerator and "dynamo_plugin" in accelerator and not state.AcceleratorState._shared_state:
        state.AcceleratorState(mixed_precision=accelerator.get("_mixed_precision"), cpu=accelerator.get("_cpu", False),
                               dynamo_plugin=accelerator["dynamo_plugin"],
                               torch_tp_plugin=accelerator.get("torch_tp_plugin"),
                               parallelism_config=accelerator.get("parallelism_config"), _from_accelerator=True)
    if gradient and not state.GradientState._shared_state:
        state.GradientState()
        state.GradientState._shared_state["plugin_kwargs"] = dict(gradient.get("plugin_kwargs", {}))


def _shared(obj, cls) -> None:
    """An accelerate state object unpickled in the rank has a dict of its own (the kernel's values): it
    shares the rank's singleton instead, made first if the rank has none."""
    if obj.__dict__ is cls._shared_state:
        return
    state = sys.modules["accelerate.state"]
    mine = obj.__dict__
    if not cls._shared_state:
        _restore_accelerate(state, mine if cls is state.PartialState else {},
                            mine if cls is state.AcceleratorState else {}, mine if cls is state.GradientState else {})
    if cls._shared_state:
        obj.__dict__ = cls._shared_state


# -- objects ---------------------------------------------------------------------------------------
def _classes() -> dict:
    """The classes this module knows, from the modules already imported (never imports one)."""
    found = {}
    for key, (module, name) in CLASSES.items():
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            found[key] = cls
    return found


def _fix(ns: dict, names, ctx, reset: bool) -> dict[str, tuple[int, str]]:
    """Make each named object the rank's own; return those that still see another world size. First the
    TrainingArguments resolve again (each resets accelerate's singletons, as transformers does), then
    the singletons that were there before are made again, then the objects that share them follow. A
    transformers Trainer made in the notebook decided its DDP settings and data sharding when made: its
    arguments are made the rank's own (it then trains as DDP), but it is named with the world size it was
    made with (its losses differ from torchrun's)."""
    known = _classes()
    every = tuple(known.values())
    values = {n: ns[n] for n in names if not n.startswith("_") and n in ns and isinstance(ns[n], every)}
    made_with = {n: _attempt(v, lambda t: t.args.world_size) for n, v in values.items()
                 if "hf_trainer" in known and isinstance(v, known["hf_trainer"])}
    saved = _snapshot(reset)
    try:
        resolved: set[int] = set()  # a TrainingArguments also reached through a Trainer: once
        for args in (_training_args(v, known) for v in values.values()):
            if args is not None and id(args) not in resolved:
                resolved.add(id(args))
                _attempt(args, _resolve_again)
    finally:
        _restore_accelerate(*saved)
    stale = {}
    for name, value in values.items():
        seen = _attempt(value, lambda v: _own(v, known))
        seen = made_with.get(name, seen)
        if seen is not None and seen != ctx.world_size:
            stale[name] = (id(value), stale_message(name, _kind(value), seen, ctx.world_size))
    return stale


def _attempt(value, fix):
    """A library's internals may change: a fix that fails is said, and never fails the cell."""
    try:
        return fix(value)
    except Exception as e:  # noqa: BLE001 - a library's internals: any failure is said
        print(f"nbddp: could not make a {type(value).__name__} made in the notebook this rank's own: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return None


def _training_args(value, known: dict):
    if "training_args" in known and isinstance(value, known["training_args"]):
        return value
    if "hf_trainer" in known and isinstance(value, known["hf_trainer"]):
        return value.args
    return None


def _own(value, known: dict) -> int | None:
    """Share the rank's accelerate singletons where the object holds them; the world size it then sees
    (None: it has none)."""
    def isa(key):
        return key in known and isinstance(value, known[key])

    if isa("training_args"):
        return value.world_size
    for key in ("partial", "accelerator_state", "gradient"):
        if isa(key):
            _shared(value, known[key])
            return getattr(value, "num_processes", None)
    if isa("accelerator"):
        _accelerator(value, known)
        return value.num_processes
    if isa("hf_trainer"):
        _accelerator(value.accelerator, known)
        return value.args.world_size
    return value.world_size  # Lightning's Fabric and Trainer: fixed when they were made


def _accelerator(acc, known: dict) -> None:
    for attr, key in (("state", "accelerator_state"), ("gradient_state", "gradient")):
        if getattr(acc, attr, None) is not None:
            _shared(getattr(acc, attr), known[key])


def _resolve_again(args) -> None:
    """A TrainingArguments caches its device (``_setup_devices``, a cached_property), ``_n_gpu`` and
    accelerate's ``PartialState`` (``distributed_state``) when made: forgotten, then resolved in the rank."""
    for attr in ("_setup_devices", "_n_gpu"):
        args.__dict__.pop(attr, None)
    args.distributed_state = None
    args._setup_devices  # noqa: B018 - the cached_property resolves device and distributed state


def _kind(value) -> str:
    cls = type(value)
    return f"a {cls.__module__.split('.')[0]} {cls.__name__}"


# -- rank_zero_only ------------------------------------------------------------------------------
def _rank_zero(rank: int, local_rank: int) -> None:
    """Lightning's and TorchMetrics' ``rank_zero_only.rank`` are read from the environment when they are
    imported (in the kernel: 0); torchrun's processes import them with their own RANK / LOCAL_RANK."""
    utilities = sys.modules.get("lightning_utilities.core.rank_zero")
    if utilities is not None and hasattr(utilities.rank_zero_only, "rank"):
        utilities.rank_zero_only.rank = rank
    metrics = sys.modules.get("torchmetrics.utilities.prints")
    if metrics is not None:
        metrics.rank_zero_only.rank = local_rank
