"""How values leave a rank: pickled once (cloudpickle), tensors moved to the CPU, checked before they travel.

With fork, a class or function the notebook defined before the cell is pickled by reference, so the
value comes back as an instance of the notebook's own class (``isinstance`` holds), not a look-alike.
Objects that cannot come back as they are (a DDP- or FSDP-wrapped module, an open file, a generator)
are refused with what to send instead.

A DTensor (tensor parallel, FSDP2, DeviceMesh code; or a state_dict, list or model holding one) is refused
with the fix, its place in the value named: pickled, it keeps one rank's shard and a DeviceMesh the kernel
cannot resolve (``full_tensor()`` fails there). Sending the full tensor instead would need every rank to join
an all-gather after the cell (``--out`` packs on rank 0 alone, ``--ranks`` runs some ranks, a rank that
failed never joins: a hang) and would put the whole model in every rank's memory; the cell gathers it in
one line, where the user sees the collective.
"""
from __future__ import annotations

import io
import pickle
import sys
import types

import cloudpickle

from ..units import size
from . import sharedtensor
from .messages import Item

NEVER_DEFINED = "never defined"  # an --out/--gather name the cell did not define on that rank
DEFAULT_MAX_VALUE_MB = 1024  # per value and rank: what one pipe should carry back to the kernel


class Unsendable(TypeError):
    """A value that cannot leave the rank as it is; the message says what to send instead."""


class DTensorFound(Unsendable):
    """A DTensor met while pickling: ``pack`` says where it is in the value and what to send."""


class _CPUPickler(cloudpickle.CloudPickler):
    """Pickles accelerator tensors as their CPU copies, so the kernel never touches a GPU."""

    def __init__(self, file, notebook: dict | None = None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._by_ref = notebook or {}  # id(obj) -> (its name in the kernel's namespace, obj)

    def reducer_override(self, obj):
        known = self._by_ref.get(id(obj))
        if known is not None and known[1] is obj:
            return _from_notebook, (known[0],)
        torch = _torch()
        if torch is not None:
            if _is_dtensor(obj):
                raise DTensorFound("a DTensor")
            if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                return _identity, (obj.detach().cpu(),)
            if isinstance(obj, torch.nn.Module):
                _refuse_wrapped(obj)
        if isinstance(obj, io.IOBase):
            raise Unsendable(f"an open file ({describe(obj)}) cannot leave its process: send its name or contents")
        if isinstance(obj, (types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType)):
            raise Unsendable(f"a {type(obj).__name__} cannot be pickled: send list(...) of what it yields")
        return super().reducer_override(obj)


def _is_dtensor(obj) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    cls = getattr(dtensor, "DTensor", None)
    return cls is not None and isinstance(obj, cls)


def _dtensor_at(obj, path: str = "", depth: int = 0, seen: set | None = None):
    """Where the first DTensor in ``obj`` is, as the code that reaches it (``['layer.weight']``, ``[0]``,
    ``.weight``; ``""``: ``obj`` itself), or None."""
    seen = set() if seen is None else seen
    if _is_dtensor(obj):
        return path
    if depth > 8 or id(obj) in seen:
        return None
    seen.add(id(obj))
    torch = _torch()
    if isinstance(obj, dict):
        children = ((f"[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        children = ((f"[{i}]", v) for i, v in enumerate(obj))
    elif torch is not None and isinstance(obj, torch.nn.Module):
        children = ((f".{k}", v) for k, v in (*obj.named_parameters(), *obj.named_buffers()))
    else:
        children = ((f".{k}", v) for k, v in getattr(obj, "__dict__", {}).items())
    for key, child in children:
        found = _dtensor_at(child, path + key, depth + 1, seen)
        if found is not None:
            return found
    return None


def _dtensor_problem(obj) -> str:
    """A DTensor refused: where it is in the value, why, and the one line that sends full tensors."""
    torch = _torch()
    at = _dtensor_at(obj)
    where = ("is a DTensor" if at == "" else "holds a DTensor (deep inside)" if at is None
             else f"holds a DTensor at {at}")
    if torch is not None and isinstance(obj, torch.nn.Module):
        fix = ("send its full state dict instead: torch.distributed.checkpoint.state_dict.get_model_state_dict("
               "model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)), run on every rank")
    elif isinstance(obj, dict):
        fix = ("gather it in the cell, on every rank (the gather is a collective): "
               "value = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in value.items()} "
               "(DTensor from torch.distributed.tensor), or for a model's state dict "
               "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) "
               "(torch.distributed.checkpoint.state_dict)")
    else:
        fix = "gather it in the cell, on every rank (the gather is a collective): send value.full_tensor() instead"
    return (f"{describe(obj)} {where}: one rank's shard on a DeviceMesh the notebook does not have (it would "
            f"arrive as rank 0's shard, and full_tensor() would fail there); {fix}")


def _refuse_wrapped(module) -> None:
    kind = type(module).__name__
    if kind == "DistributedDataParallel":
        raise Unsendable("a DistributedDataParallel model holds the rank's process group: "
                         "send model.module.state_dict() (or model.module) instead")
    if kind == "FullyShardedDataParallel" or any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
        raise Unsendable("an FSDP-sharded model holds only this rank's shards: send "
                         "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options="
                         "StateDictOptions(full_state_dict=True, cpu_offload=True)) instead")


class RankPickler(cloudpickle.CloudPickler):
    """cloudpickle, keeping each notebook function's file name (cloudpickle >= 3.1.3 writes "<dynamic-code>"):
    a rank's traceback then labels its frames ``Cell In[n]``, as the notebook's would."""

    dispatch_table = dict(cloudpickle.CloudPickler.dispatch_table)
    _code = dispatch_table.get(types.CodeType)

    def _keep_filename(code, _reduce=_code):
        rebuild, args = _reduce(code)
        return rebuild, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)

    if _code is not None:
        dispatch_table[types.CodeType] = _keep_filename

    def reducer_override(self, obj):
        # a notebook tensor or array of this machine: its bytes once in shared memory, a handle in the pickle
        return sharedtensor.reduce(obj) or super().reducer_override(obj)


def to_ranks(obj) -> bytes:
    """A notebook value pickled for the ranks (by value: spawn, forkserver, a pool's updates, another node):
    big tensors and arrays through shared memory (sharedtensor.py), unless under ``memfd.elsewhere()``."""
    buf = io.BytesIO()
    with sharedtensor.sharer().send():
        RankPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _identity(x):
    return x


def _from_notebook(name: str):
    """In the kernel: the notebook's own object of that name (the class an instance belongs to)."""
    main = sys.modules.get("__main__")
    try:
        return getattr(main, name)
    except AttributeError:
        from IPython import get_ipython

        return get_ipython().user_ns[name]


def _torch():
    return sys.modules.get("torch")  # never imports torch: a value without tensors needs none


def notebook_objects(namespace: dict) -> dict[int, tuple]:
    """Classes and functions the notebook defined (id -> (name, obj)): what fork sends by reference.
    Taken before the cell runs, so a class the cell itself (re)defines travels by value."""
    return {id(v): (k, v) for k, v in namespace.items()
            if isinstance(v, (type, types.FunctionType)) and getattr(v, "__module__", None) == "__main__"
            and not k.startswith("_")}


# Python's immutable scalars: pickle writes them the same way with or without nbddp's reducers, so a cell's
# usual last value (t.item(), a loss, a count) skips building a CloudPickler (~50 us); sending.py compares
# them by value
PLAIN = (int, float, bool, complex, str, bytes, type(None))


def dumps(obj, notebook: dict | None = None) -> bytes:
    if type(obj) in PLAIN:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = io.BytesIO()
    _CPUPickler(buf, notebook).dump(obj)
    return buf.getvalue()


def loads(data: bytes):
    return pickle.loads(data)


def pack(obj, *, max_bytes: int, notebook: dict | None = None) -> Item:
    """One value as an Item: pickled, or the reason it cannot travel (never raises)."""
    try:
        blob = dumps(obj, notebook)
    except DTensorFound:
        return Item(problem=_dtensor_problem(obj))
    except Unsendable as e:
        return Item(problem=f"{describe(obj)}: {e}")
    except Exception as e:  # noqa: BLE001 - pickling raises anything: said
        return Item(problem=f"{describe(obj)} cannot be pickled: {type(e).__name__}: {e}")
    if len(blob) > max_bytes:
        return Item(problem=f"{describe(obj)} is {size(len(blob))} pickled, over the limit of {size(max_bytes)} "
                            "(--max-value-mb): send a smaller part, or save it to a file and load it in the notebook")
    return Item(blob=blob)



def describe(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__
