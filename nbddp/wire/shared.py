"""``nbddp.shared(obj)``: a read-only twin of notebook data made of Python objects, its contents in one
shared-memory buffer that ranks, and the DataLoader workers they fork, read without writing.

Why: CPython writes an object's reference count each time it is read, so a forked rank that reads a list
of dicts copies every page it touches (3M dicts: +423 MiB per rank, measured; ``gc.freeze()`` does not
help). A twin keeps each item pickled in one buffer: reading item i unpickles a fresh object from
bytes nobody writes, so the pages stay shared, in every rank and every loader worker.

- a list or tuple → ``SharedSequence``: ``len``, indexing (negative too), slices (views on the same
  buffer), iteration; each item equal to the original (a fresh object at each read: writes to it are
  not kept);
- a pandas DataFrame or Series → a ``DataFrame``/``Series`` (subclasses) with equal values: numbers,
  booleans and dates as numpy arrays on the buffer, strings as Arrow arrays on it (needs pyarrow),
  categoricals as their codes; a column it cannot keep is refused by name, with the reason;
- what is already shared (tensors, numpy arrays, a ``datasets.Dataset``, a twin) comes back as it is.

The buffer is a memfd. A fork inherits its mapping; anywhere else (a pool started before the call, a
spawned rank, a Ray node on the same machine) the twin travels by handle (the kernel's pid, fd and the
buffer's inode) and is mapped there, never copied. To another machine (a Ray node) the bytes travel once
per node (under ``memfd.elsewhere()``) into a file of the node's run directory that its ranks map.
"""
from __future__ import annotations

import collections.abc
import itertools
import pickle
import sys
from array import array

import cloudpickle

from ..errors import UsageError
from ..units import size
from .sharedbuffer import Buffer, BufferWriter

_BATCH = 8 * 2**20  # bytes pickled before one write to the buffer


def shared(obj):
    """A read-only twin of ``obj`` that ranks read without copying (module docstring)."""
    if _already_shared(obj):
        return obj
    if isinstance(obj, (list, tuple)):
        return SharedSequence.of(obj)
    kind = _pandas_kind(obj)
    if kind is not None:
        from . import sharedframe

        return sharedframe.share(obj, kind)
    hint = ("share list(d.items()) or list(d.values()) instead" if isinstance(obj, dict)
            else "tensors and numpy arrays are shared by the fork as they are")
    raise UsageError(f"nbddp.shared takes a list or tuple, or a pandas DataFrame or Series; not "
                     f"{type(obj).__name__}: {hint}.")


def _already_shared(obj) -> bool:
    t = type(obj)
    if isinstance(obj, SharedSequence) or t.__module__ == f"{__package__}.sharedframe":
        return True
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")  # never imported for this
    if torch is not None and isinstance(obj, torch.Tensor) or numpy is not None and isinstance(obj, numpy.ndarray):
        return True
    return t.__module__.startswith("datasets.") and t.__qualname__ in ("Dataset", "DatasetDict")


def _pandas_kind(obj) -> str | None:
    for cls in type(obj).__mro__:
        if cls.__module__.partition(".")[0] == "pandas" and cls.__name__ in ("DataFrame", "Series"):
            return cls.__name__
    return None


# -- a list or tuple ------------------------------------------------------------------------------------------
def _dumps(item) -> bytes:
    try:
        return pickle.dumps(item, protocol=5)
    except Exception:  # noqa: BLE001 - a lambda, a class the notebook defined...: by value
        return cloudpickle.dumps(item, protocol=5)


class SharedSequence(collections.abc.Sequence):
    """A read-only sequence over items pickled one after the other in a shared buffer (``nbddp.shared``)."""

    __slots__ = ("_buf", "_layout", "_offsets", "_data", "_index", "__weakref__")

    def __init__(self, buf: Buffer, count: int, data_at: int, offsets_at: int, index: range | None = None):
        self._buf, self._layout = buf, (count, data_at, offsets_at)
        self._offsets = buf.view[offsets_at:offsets_at + 8 * (count + 1)].cast("q")
        self._data = buf.view[data_at:]
        self._index = range(count) if index is None else index

    @classmethod
    def of(cls, items) -> SharedSequence:
        out = BufferWriter("seq")
        offsets = array("q", [0])
        batch, size, total = [], 0, 0
        data_at = out.append(b"")
        for item in items:
            blob = _dumps(item)
            batch.append(blob)
            size += len(blob)
            total += len(blob)
            offsets.append(total)
            if size >= _BATCH:
                out.extend(b"".join(batch))
                batch, size = [], 0
        out.extend(b"".join(batch))
        offsets_at = out.append(offsets)
        return cls(out.seal(), len(items), data_at, offsets_at)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._view(self._index[i])
        j = self._index[i]  # IndexError, negative indices: as a list's
        return pickle.loads(self._data[self._offsets[j]:self._offsets[j + 1]])

    def __iter__(self):
        data, offsets, loads = self._data, self._offsets, pickle.loads
        for j in self._index:
            yield loads(data[offsets[j]:offsets[j + 1]])

    def _view(self, index: range) -> SharedSequence:
        view = SharedSequence.__new__(SharedSequence)
        view._buf, view._layout, view._offsets, view._data = self._buf, self._layout, self._offsets, self._data
        view._index = index
        return view

    def __eq__(self, other):
        if isinstance(other, (SharedSequence, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        head = ", ".join(repr(x) for x in itertools.islice(self, 3))
        more = ", ..." if len(self) > 3 else ""
        return f"nbddp.shared([{head}{more}]) ({len(self):,} items, {size(self._buf.size)} shared)"

    def __reduce__(self):
        return SharedSequence, (self._buf, *self._layout, self._index)

