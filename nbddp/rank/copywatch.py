"""Copy-on-read, said when it happens: a cell that reads a large notebook container of Python objects
(a list of dicts, a DataFrame with Python string columns) copies every page it reads into the rank
(CPython writes each object's reference count as it reads it). Around such a cell, and only such a cell,
the rank measures its private memory; the kernel says which names, by how much, and the fix
(``rows = nbddp.shared(rows)``) once the growth passes ``NOTE_BYTES``. Tensors, numpy arrays and
``nbddp.shared`` twins are never flagged: their data has no per-item object to write to.
"""
from __future__ import annotations

import functools
import os

from ..hw import procmem
from ..units import size

LARGE_ITEMS = 10_000  # a container at least this long is worth watching
NOTE_BYTES = 100 * 2**20  # a growth this large is worth a note
_CONTAINERS = (list, tuple, dict, set, frozenset)


@functools.lru_cache(maxsize=64)
def _names(code) -> frozenset:
    from ..ipy.cellcode import names_used

    return frozenset(names_used(code))


def watched(codes, ns: dict) -> tuple[str, ...]:
    """The names the cell's code reads whose values are large Python containers (notebook data a fork
    shares until it is read)."""
    found = []
    for name in sorted(set().union(*(_names(c) for c in codes if c is not None))):
        value = ns.get(name)
        if value is not None and _objects(value):
            found.append(name)
    return tuple(found)


def _objects(value) -> bool:
    if isinstance(value, _CONTAINERS):
        return len(value) >= LARGE_ITEMS
    kind = type(value).__module__.partition(".")[0]
    if kind == "pandas" and type(value).__name__ in ("DataFrame", "Series") and len(value) >= LARGE_ITEMS:
        dtypes = value.dtypes if type(value).__name__ == "DataFrame" else [value.dtype]
        return any(d == object or getattr(d, "storage", None) == "python" for d in dtypes)  # noqa: E721 - numpy dtypes
    return False


def private_bytes() -> int:
    """This process's private memory (USS, as the dashboard shows it), from one read of smaps_rollup."""
    try:
        return procmem.uss_of(os.getpid())
    except procmem.Gone:
        return 0


class CopyWatch:
    """``with CopyWatch(names, ns) as w:`` around the cell; ``w.copied``: (growth in bytes, ((name, what it
    holds), ...)) once it passed NOTE_BYTES, else ()."""

    def __init__(self, names: tuple, ns: dict):
        self.names, self.copied = names, ()
        self.held = tuple((n, describe(ns[n])) for n in names)

    def __enter__(self):
        self.before = private_bytes() if self.names else 0
        return self

    def __exit__(self, *exc):
        if self.names:
            grew = private_bytes() - self.before
            if grew >= NOTE_BYTES:
                self.copied = (grew, self.held)
        return False


def note(copied: dict) -> str | None:
    """The cell's note, from each rank's ``copied`` (rank -> (bytes, ((name, what it holds), ...)))."""
    if not copied:
        return None
    held = dict(pair for _, pairs in copied.values() for pair in pairs)
    grew = ", ".join(f"rank {r} +{size(b)}" for r, (b, _) in sorted(copied.items()))
    which = " and ".join(f"`{n}` ({what})" for n, what in sorted(held.items()))
    fix = "; ".join(f"{n} = nbddp.shared({n})" for n in sorted(held))
    return (f"this cell copied notebook data into its ranks as it read {which}: private memory {grew}. "
            "A fork shares Python objects only until they are read (reading one writes its reference count, "
            f"so its page is copied into the rank). Share them instead, in the notebook: {fix}")


def describe(value) -> str:
    if isinstance(value, _CONTAINERS):
        return f"a {type(value).__name__} of {len(value):,} items"
    return f"a {type(value).__name__} of {len(value):,} rows"

