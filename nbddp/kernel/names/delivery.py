"""Values back into the notebook: ``--out`` names from rank 0, ``--gather`` names from every rank, rank 0's
last expression as the cell's ``Out[n]`` (``deliver``, on the notebook's thread), and a background cell's
last value shown in its own output instead (``shown_in_place``)."""
from __future__ import annotations

import dataclasses

from ...errors import ResultError
from ...ipy import cellcode
from ...views import output
from ...wire import values


def shown_in_place(per_rank: list, shell) -> list:
    """A background cell's ranks' results, rank 0's last value displayed in the cell's own output (its
    Out[n] is long past), and taken out of what ``deliver`` gets."""
    first = per_rank[0] if per_rank else None
    if first is not None and first.value is not None and first.value.blob is not None:
        value = values.loads(first.value.blob)
        if value is not None:
            data, metadata = shell.display_formatter.format(value)
            output.current().display(data, metadata, None)
        per_rank = [dataclasses.replace(first, value=None), *per_rank[1:]]
    return per_rank


def deliver(per_rank: list, outs: list[str], gathers: list[str], user_ns: dict, source: str | None = ""):
    """--out names from rank 0, --gather names from every rank, into the notebook; every name that can
    arrive does, then one ResultError names each that could not (rank, name, why, what to do: a name never
    bound gets the cell's close names, a value that cannot travel what to send instead)."""
    problems = []
    arrived = []
    unsendable = []

    def load(rank: int, name: str, item):
        flag = "--out" if name in outs else "--gather"
        if item is None or item.problem == values.NEVER_DEFINED:
            problems.append(f"{flag} {name}: rank {rank} never defined `{name}`: "
                            f"{_unbound(name, rank, flag, source, user_ns)}")
            return None, False
        if item.problem:
            problems.append(f"{flag} {name}: rank {rank}'s `{name}`: {item.problem}.")
            unsendable.append(name)
            return None, False
        try:
            return values.loads(item.blob), True
        except Exception as e:  # noqa: BLE001 - a value the kernel cannot rebuild is named, not raised
            problems.append(f"{name}: rank {rank}'s value cannot be unpickled in the kernel: {type(e).__name__}: {e}.")
            unsendable.append(name)
            return None, False

    first = per_rank[0]
    for name in outs:
        value, ok = load(0, name, first.outs.get(name))
        if ok:
            user_ns[name] = value
            arrived.append(name)
    for name in gathers:
        loaded = [load(r, name, res.gathers.get(name)) for r, res in enumerate(per_rank)]
        if all(ok for _, ok in loaded):
            user_ns[name] = [v for v, _ in loaded]
            arrived.append(name)
    if problems:
        problems.append(
            "The cell ran on every rank; " + (f"these arrived: {', '.join(arrived)}."
                                              if arrived else "nothing arrived.")
            + ("\nSend plain data instead (tensors, numbers, dicts, a state_dict), or leave the name out."
               if unsendable else "")
        )
        raise ResultError("\n".join(problems))
    return values.loads(first.value.blob) if first.value is not None else None


def _unbound(name: str, rank: int, flag: str, source: str | None, user_ns: dict) -> str:
    """Why ``name`` was never bound on ``rank``, and what to do: a branch that rank skipped, or a name the
    cell never assigns (a typo: its close names among those the cell assigns, then the notebook's). ``source``
    None: a cell the kernel before ran (a taken --bg one), whose source is not known here."""
    import difflib

    where = "on every rank" if flag == "--gather" else "on rank 0"
    if source is None:
        return f"that cell (run by the kernel before) did not bind it there. Assign `{name}` {where}, or leave it " \
               f"out of {flag}."

    bound = sorted(n for n in cellcode.names_bound(source) if not n.startswith("_"))
    if name in bound:
        return (f"the cell assigns it, but not on rank {rank} (a branch that rank did not take, or an exception "
                f"it caught first). Assign `{name}` {where}, or leave it out of {flag}.")
    assigns = f" (it assigns {', '.join(bound[:8])}{', ...' if len(bound) > 8 else ''})" if bound else ""
    if name in user_ns:  # a notebook name the ranks lack (a pool started before it, a spawned rank)
        return (f"the cell never assigns it{assigns}; the notebook has `{name}`, but {flag} brings back what the "
                f"cell assigns on the ranks. Assign `{name}` in the cell {where}, or leave it out of {flag}.")
    known = [n for n in user_ns if not n.startswith("_")]
    close = difflib.get_close_matches(name, bound, n=3) or difflib.get_close_matches(name, known, n=3)
    fix = (f" Did you mean {' or '.join(f'`{c}`' for c in close)}? Put the name the cell assigns after {flag}"
           if close else f" Put a name the cell assigns after {flag}")
    return (f"the cell never assigns it{assigns}, and the notebook has no such name.{fix}, or assign `{name}` "
            f"in the cell {where}.")
