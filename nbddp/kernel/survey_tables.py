"""``%ddp who`` and ``%ddp diff EXPR``: a pool's ranks seen side by side. Each rank takes a survey
(rank/survey.py); here they are compared and shown as one table, a mark where ranks disagree."""
from __future__ import annotations

from ..rank.survey import Survey
from . import failure


def who(pool) -> None:
    per_rank = pool.run_job(Survey(), "%ddp who")
    print(who_table(per_rank))


def who_table(per_rank: list[dict]) -> str:
    """One row per name: type, shape/dtype/device, size; ``≠`` and each rank's where they disagree."""
    ranks = len(per_rank)
    names = sorted(set().union(*per_rank), key=str.lower)
    rows = []
    for name in names:
        seen = [r.get(name) for r in per_rank]
        have = [i for i, s in enumerate(seen) if s is not None]
        kinds = {(s[0], s[1]) for s in seen if s is not None}
        first = seen[have[0]]
        size = _size(first[2])
        if len(have) < ranks:
            rows.append((name, first[0], f"≠ on {failure.ranks_text(have)} only", size))
        elif len(kinds) == 1:
            rows.append((name, first[0], first[1], size))
        else:
            rows.append((name, " / ".join(sorted({k for k, _ in kinds})),
                         "≠ " + "; ".join(f"rank {i}: {s[1] or s[0]}" for i, s in enumerate(seen)), size))
    head = f"nbddp who · {len(names)} name(s) on {ranks} rank(s); ≠ where ranks disagree in type or shape"
    return head + "\n" + _table(("name", "type", "what", "size"), rows)


def diff(pool, expr: str) -> None:
    per_rank = pool.run_job(Survey(expr), f"%ddp diff {expr}")
    print(diff_table(expr, per_rank))


def diff_table(expr: str, per_rank: list[dict]) -> str:
    """Per entry: whether every rank holds the same (by hash), and where not, by how much (norms)."""
    keys = list(dict.fromkeys(k for r in per_rank for k in r))
    rows, differ, sharded = [], 0, False
    for key in keys:
        fps = [r.get(key) for r in per_rank]
        sharded |= any(fp and fp.get("shard") for fp in fps)
        if all(fp is not None for fp in fps) and len({fp["hash"] for fp in fps}) == 1:
            continue
        differ += 1
        rows.append((key, fps[0]["what"] if fps[0] else "", _how(fps)))
    agree = len(keys) - differ
    entries = f"{len(keys)} entr{'y' if len(keys) == 1 else 'ies'}"
    head = (f"nbddp diff {expr} · {len(per_rank)} ranks: " +
            (f"all {entries} agree" if not differ else
             f"{differ} of {entries} {'differs' if differ == 1 else 'differ'}, {agree} agree"))
    if sharded:
        head += " (DTensor entries: each rank's own shard compared, so shards differ by design)"
    return head if not rows else head + "\n" + _table(("entry", "what", "how the ranks differ"), rows)


def _how(fps: list) -> str:
    missing = [i for i, fp in enumerate(fps) if fp is None]
    if missing:
        return f"missing on {failure.ranks_text(missing)}"
    whats = {fp["what"] for fp in fps}
    if len(whats) > 1:
        return "; ".join(f"rank {i}: {fp['what']}" for i, fp in enumerate(fps))
    if all("norm" in fp for fp in fps):
        base = fps[0]["norm"]
        worst = max(abs(fp["norm"] - base) for fp in fps)
        rel = worst / abs(base) if base else float("inf") if worst else 0.0
        parts = [f"rank {i}: {fp.get('shown') or format(fp['norm'], '.6g')}" for i, fp in enumerate(fps)]
        label = "values" if "shown" in fps[0] else "norms"
        return f"{label} {', '.join(parts)} (largest relative gap {rel:.2g})" if rel else \
            f"same norm ({base:.6g}) but other values"
    return "; ".join(f"rank {i}: {fp.get('shown', fp['what'])}" for i, fp in enumerate(fps))


def _size(n) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _table(head: tuple, rows: list) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows))
