"""How values leave a rank: cloudpickle over a private pipe, with tensors moved to the CPU first."""
from __future__ import annotations

import io
import pickle
import struct
import sys

import cloudpickle


class _CPUPickler(cloudpickle.CloudPickler):
    """Pickles accelerator tensors as their CPU copies, so the kernel never touches a GPU."""

    def reducer_override(self, obj):
        torch = _torch()
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return _identity, (obj.detach().cpu(),)
        return super().reducer_override(obj)


def _identity(x):
    return x


def _torch():
    return sys.modules.get("torch")  # never imports torch: a value without tensors needs none


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _CPUPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes):
    return pickle.loads(data)


def describe(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def frame(payload: bytes) -> bytes:
    """Length-prefixed message, so the parent knows a result arrived whole."""
    return struct.pack("<Q", len(payload)) + payload


def unframe(data: bytes) -> bytes | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n] if len(data) >= 8 + n else None
