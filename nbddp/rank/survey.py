"""In a pool's rank: the survey ``%ddp who`` and ``%ddp diff`` take there (the kernel's tables of them:
kernel/names/survey_tables.py). Only summaries travel: for each of the user's names its type, shape, dtype, device
and size; for each entry of an expression's value (a dict or state_dict key, a list index, or the value
itself) a fingerprint (shape, dtype, a hash of the bytes, norm and sum). A DTensor (FSDP2) is fingerprinted
by the shard this rank holds, and says so.

``who`` lists what IPython's ``%who`` lists, less what is not the user's data: no names IPython put there
(``open``, ``In``, ``exit``: its ``user_ns_hidden``), no modules, no classes or functions merely imported
(``DDP``, ``sqrt``); the notebook's own classes and functions are listed."""
from __future__ import annotations

import hashlib
import sys
import types
from dataclasses import dataclass

from ..ipy.cellcode import notebook_name
from ..wire import values
from ..wire.messages import Result

MAX_ENTRIES = 10_000  # entries of one value fingerprinted (a state_dict of a very large model is cut here)
HIDDEN = {"rank", "local_rank", "world_size", "device"}  # differ on every rank by design


@dataclass
class NamespaceSurvey:
    """``who`` (expr None) or ``diff`` of ``expr``, as a job for ``Pool.run``'s path (a ``Call``)."""

    expr: str | None = None

    def __call__(self, ctx) -> Result:
        ns = ctx.namespace
        data = who(ns) if self.expr is None else fingerprints(eval(self.expr, ns))  # the user's own
        return Result(value=values.pack(data, max_bytes=1 << 30))


def who(ns: dict) -> dict:
    """name -> (type, what it is: shape dtype device, size in bytes or None), for the user's names."""
    hidden = _ipython_hidden()
    out = {}
    for name, value in ns.items():
        if name.startswith("_") or name in HIDDEN or not notebook_name(name) or value is hidden.get(name, _NONE):
            continue
        if not _users_data(value):
            continue
        out[name] = describe(value)
    return out


_NONE = object()
_CODE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType)


def _users_data(value) -> bool:
    """Not a module, nor a class or function imported from one (the notebook's own are its ``__main__``'s)."""
    if isinstance(value, types.ModuleType):
        return False
    if isinstance(value, _CODE) or callable(value) and isinstance(getattr(value, "__wrapped__", None), _CODE):
        return getattr(value, "__module__", None) == "__main__"
    return True


def _ipython_hidden() -> dict:
    """IPython's ``user_ns_hidden`` (``open``, ``In``, ``exit``, ...: what its ``%who`` leaves out), as the
    rank's copy of the kernel's shell holds it; empty outside IPython (a spawned rank)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "user_ns_hidden", None) or {}


def describe(value) -> tuple:
    torch = sys.modules.get("torch")
    kind = type(value).__name__
    if torch is not None and isinstance(value, torch.Tensor):
        local = _local(value)
        shard = " (this rank's shard)" if local is not value else ""
        return kind, f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')} {value.device}{shard}", \
            local.element_size() * local.nelement()
    if torch is not None and isinstance(value, torch.nn.Module):
        params = sum(p.numel() for p in value.parameters())
        return kind, f"{params:,} parameters", sum(p.element_size() * p.nelement() for p in value.parameters())
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):  # numpy, pandas
        return kind, f"{tuple(shape)} {value.dtype}", getattr(value, "nbytes", None)
    if isinstance(value, (list, tuple, dict, set)):
        return kind, f"{len(value)} item(s)", None
    if isinstance(value, (int, float, bool, str)):
        text = repr(value)
        return kind, text if len(text) <= 40 else text[:37] + "...", None
    return kind, "", None


def fingerprints(value) -> dict:
    """entry -> fingerprint (a dict), for each leaf of ``value`` (nested dicts, lists, tuples)."""
    out: dict = {}
    _walk(value, "", out)
    return out


def _walk(value, key: str, out: dict) -> None:
    if len(out) >= MAX_ENTRIES:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{key}.{k}" if key else str(k), out)
    elif isinstance(value, (list, tuple)) and not _is_leaf(value):
        for i, v in enumerate(value):
            _walk(v, f"{key}[{i}]", out)
    else:
        out[key or "(value)"] = _fingerprint(value)


def _is_leaf(value) -> bool:
    return len(value) > 64 and all(isinstance(v, (int, float, bool)) for v in value[:64])  # a list of numbers


def _fingerprint(value) -> dict:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        local = _local(value)
        t = local.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.nelement() else b""
        stats = t.double() if not t.is_complex() else t.abs().double()
        return {"what": f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}",
                "hash": hashlib.blake2b(data, digest_size=16).hexdigest(),
                "norm": float(stats.norm()) if t.nelement() else 0.0,
                "sum": float(stats.sum()) if t.nelement() else 0.0,
                "shard": local is not value}
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return _fingerprint(torch.from_numpy(value)) if torch is not None and value.dtype != object else \
            {"what": f"ndarray {value.shape}", "hash": hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest()}
    text = repr(value)
    fp = {"what": type(value).__name__, "hash": hashlib.blake2b(text.encode(), digest_size=16).hexdigest(),
          "shown": text if len(text) <= 60 else text[:57] + "..."}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        fp["norm"] = abs(float(value))
    return fp


def _local(t):
    """A DTensor's local shard (what this rank holds); any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t).__name__ == "DTensor" else t
