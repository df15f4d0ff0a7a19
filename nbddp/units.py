"""How nbddp writes a size and a set of ranks: one convention each, for every view, note and message.

Sizes in IEC units (``size``: 850 B, 4.5 KiB, 12.3 MiB, 123 MiB, 1.2 GiB), ranks as ranges (``rank_span``:
``0-2,5``, the label of a line several ranks printed alike, ``[rank0-2,5]:``; ``ranks_text``: ``rank 3``,
``ranks 0-15,17,20-63`` in prose, so 600 ranks fit one line); durations as a user writes them (``seconds``:
``30s``, ``10m``, ``2h``, ``90``). It imports nothing: every part of the package,
rank, wire and hardware seams included, may use it.
"""
from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size(n: float | None) -> str:
    """``n`` bytes in the largest IEC unit under 1024 of it: whole bytes, else one decimal below 100 of the
    unit and none from 100 (at most four digits: 850 B, 4.5 KiB, 99.9 MiB, 123 MiB, 1.2 GiB); ``-``: not known."""
    if n is None:
        return "-"
    value, unit = float(n), 0
    while abs(value) >= 1023.5 and unit < len(UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{value:.0f} B"
    return f"{value:.1f} {UNITS[unit]}" if abs(value) < 99.95 else f"{value:.0f} {UNITS[unit]}"


def rank_span(ranks) -> str:
    """Ranks as ranges, in order: 0,1,2,5 -> ``0-2,5`` (two in a row are a range too: ``0-1``)."""
    out, run = [], []
    for r in sorted(ranks):
        if run and r != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(r)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def ranks_text(ranks, word: bool = True) -> str:
    """``rank 3`` / ``ranks 0-15,17,20-63`` (``word``: False, the ranges alone)."""
    ranks = list(ranks)
    text = rank_span(ranks)
    if not word:
        return text
    return f"rank {text}" if len(set(ranks)) == 1 else f"ranks {text}"


def seconds(text) -> float:
    """A duration as a user writes it (``30s``, ``10m``, ``2h``, ``1.5h``, ``90``: seconds) -> seconds > 0;
    ValueError otherwise."""
    text = str(text).strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:]) if text else None
    number = float(text[:-1] if scale else text) * (scale or 1)
    if not 0 < number < float("inf"):
        raise ValueError(text)
    return number
