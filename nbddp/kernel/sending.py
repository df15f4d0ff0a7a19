"""Notebook values sent to ranks by value, each pickled once in the kernel, one that cannot be named
with why: the globals a spawned rank's cell reads (``ship_globals``), and what a pool's ranks do not
have yet (``Synced``: names the notebook created or rebound since the ranks last saw them)."""
from __future__ import annotations

import builtins
import types
import weakref


from ..errors import UsageError
from ..ipy.cellcode import names_used, notebook_name, split_last_expression
from ..wire import values


def ship_globals(source: str, filename: str, user_ns: dict) -> dict[str, bytes]:
    """The globals a spawned rank needs, each pickled by value (a module by name), with the names a
    notebook function or class among them reads; an unpicklable one is named."""
    body, last = split_last_expression(source, filename)
    pending = sorted(names_used(body) | (names_used(last) if last else set()))
    shipped = {}
    while pending:
        name = pending.pop(0)
        if name in shipped or name not in user_ns or not notebook_name(name):
            continue
        if hasattr(builtins, name) and user_ns[name] is getattr(builtins, name):
            continue
        pending += sorted(_reads(user_ns[name]) - set(shipped))  # its globals: the rank's own once it arrives
        try:
            shipped[name] = values.to_ranks(user_ns[name])
        except Exception as e:  # noqa: BLE001
            raise UsageError(
                f"--start-method spawn must send the global `{name}` ({values.describe(user_ns[name])}) to every "
                f"rank, but it cannot be pickled:\n  {type(e).__name__}: {e}\n"
                f"Create `{name}` inside the cell, or use --start-method fork (it shares the notebook's objects)."
            ) from None
    return shipped


BIG_UPDATE = 16 * 2**20  # a sent value this large earns the hint that %ddp restart shares it instead


class Synced:
    """Which notebook values the ranks have: a name the notebook created or rebound since the pool
    started (or since it was last sent) is sent again, even to an equal value; one the ranks assigned
    themselves stays theirs unless the notebook rebinds it too (last writer wins). A function or class
    the notebook defined brings the notebook names its code reads that the ranks lack."""

    def __init__(self, namespace: dict):
        self._known = {k: _token(v) for k, v in namespace.items()}

    def rebound(self, names) -> None:
        """Names a notebook cell just bound (an assignment, def, import...): sent at the next cell that
        reads them, whatever their value."""
        for name in names:
            self._known.pop(name, None)

    def accept(self, names, namespace: dict) -> None:
        """Names the notebook just received from the ranks (--out, --gather): not changes to send back."""
        for name in names:
            if name in namespace:
                self._known[name] = _token(namespace[name])

    def changes(self, names, namespace: dict, rank_assigned: set) -> tuple[dict, list[str]]:
        updates, sizes, both = {}, [], []
        pending = sorted(names)
        while pending:
            name = pending.pop(0)
            if name in updates or name not in namespace or not notebook_name(name):
                continue
            value = namespace[name]
            if _same(self._known.get(name), value):
                continue
            pending += sorted(_reads(value) - set(updates))  # what a notebook function reads goes with it
            try:
                blob = values.to_ranks(value)
            except Exception as e:  # noqa: BLE001
                raise UsageError(f"`{name}` changed in the notebook since %ddp start and must be sent to every "
                                 f"rank, but it cannot be pickled: {type(e).__name__}: {e}\nNothing ran. "
                                 "Create it inside a %%ddp cell, or %ddp restart (the ranks then share it).") from None
            updates[name] = blob
            self._known[name] = _token(value)
            if not isinstance(value, types.ModuleType):  # a module travels by name: the rank imports it
                sizes.append(f"{name} ({values.describe(value)}, {_size(len(blob))})")
            if name in rank_assigned:
                both.append(name)
        said = []
        if sizes:
            total = sum(len(b) for b in updates.values())
            said.append(f"sent {', '.join(sizes)} to every rank (new or rebound in the notebook since the pool "
                        "started)" + ("; %ddp restart shares big data copy-on-write instead" if total >= BIG_UPDATE
                                      else ""))
        if both:
            said.append(f"{', '.join(both)} changed both in the notebook and on the ranks: the ranks now use "
                        "the notebook's value")
        return updates, said


def _token(value):
    if isinstance(value, values.PLAIN):
        return ("v", type(value), value)
    try:
        return ("w", weakref.ref(value))
    except TypeError:
        return ("i", id(value))


def _same(token, value) -> bool:
    if token is None:
        return False
    kind = token[0]
    if kind == "v":
        return type(value) is token[1] and value == token[2]
    if kind == "w":
        return token[1]() is value
    return token[1] == id(value)


def _reads(value) -> set[str]:
    """The global names a function or class the notebook defined reads (none for other values)."""
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        return names_used(value.__code__)
    if isinstance(value, type) and value.__module__ == "__main__":
        found = set()
        for attr in vars(value).values():
            func = getattr(attr, "__func__", attr)
            if isinstance(func, types.FunctionType):
                found |= names_used(func.__code__)
        return found
    return set()


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} B"
