"""``%ddp who`` and ``%ddp diff EXPR``: a pool's ranks seen side by side. Each rank takes a survey
(rank/survey.py); here they are compared and shown as one table, a mark where ranks disagree.

A table fits a notebook's output at 1200 px with the sidebar open (``WIDTH`` characters): each column has
a cap, a long key elided in its middle (its end says which entry) and a long value at its end; the HTML
table a notebook shows holds each whole cell as its hover title, the text one (a terminal, a log) the
elided cells only."""
from __future__ import annotations

import html

from ...rank.survey import NamespaceSurvey
from ...units import ranks_text, size
from ...views.output import text_table

WIDTH = 110  # characters of a row: JupyterLab's output at 1200 px, sidebar open, in its monospace font
WHO_CAPS = (18, 24, 52, 10)  # name, type, what, size
DIFF_CAPS = (32, 20, 54)  # entry, what, how the ranks differ


def who(pool) -> None:
    per_rank = pool.run_job(NamespaceSurvey(), "%ddp who")
    _show(*who_parts(per_rank))


def who_parts(per_rank: list[dict]) -> tuple:
    """One row per name: type, shape/dtype/device, size; ``≠`` and each rank's where they disagree."""
    ranks = len(per_rank)
    names = sorted(set().union(*per_rank), key=str.lower)
    rows = []
    for name in names:
        seen = [r.get(name) for r in per_rank]
        have = [i for i, s in enumerate(seen) if s is not None]
        kinds = {(s[0], s[1]) for s in seen if s is not None}
        first = seen[have[0]]
        shown = "" if first[2] is None else size(first[2])
        if len(have) < ranks:
            rows.append((name, first[0], f"≠ on {ranks_text(have)} only", shown))
        elif len(kinds) == 1:
            rows.append((name, first[0], first[1], shown))
        else:
            rows.append((name, " / ".join(sorted({k for k, _ in kinds})),
                         "≠ " + "; ".join(f"rank {i}: {s[1] or s[0]}" for i, s in enumerate(seen)), shown))
    head = f"nbddp who · {len(names)} name(s) on {ranks} rank(s); ≠ where ranks disagree in type or shape"
    return head, ("name", "type", "what", "size"), rows


def diff(pool, expr: str) -> None:
    per_rank = pool.run_job(NamespaceSurvey(expr), f"%ddp diff {expr}")
    _show(*diff_parts(expr, per_rank), caps=DIFF_CAPS)


def diff_table(expr: str, per_rank: list[dict]) -> str:
    """Per entry: whether every rank holds the same (by hash), and where not, by how much (norms)."""
    head, columns, rows = diff_parts(expr, per_rank)
    return head if not rows else head + "\n" + _table(columns, rows, DIFF_CAPS)


def diff_parts(expr: str, per_rank: list[dict]) -> tuple:
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
    return head, ("entry", "what", "how the ranks differ"), rows


def _how(fps: list) -> str:
    missing = [i for i, fp in enumerate(fps) if fp is None]
    if missing:
        return f"missing on {ranks_text(missing)}"
    whats = {fp["what"] for fp in fps}
    if len(whats) > 1:
        return "; ".join(f"rank {i}: {fp['what']}" for i, fp in enumerate(fps))
    if all("norm" in fp for fp in fps):
        base = fps[0]["norm"]
        worst = max(abs(fp["norm"] - base) for fp in fps)
        rel = worst / abs(base) if base else float("inf") if worst else 0.0
        parts = [f"rank {i}: {fp.get('shown') or format(fp['norm'], '.6g')}" for i, fp in enumerate(fps)]
        label = "values" if "shown" in fps[0] else "norms"
        return f"largest relative gap {rel:.2g}; {label} {', '.join(parts)}" if rel else \
            f"same norm ({base:.6g}) but other values"
    return "; ".join(f"rank {i}: {fp.get('shown', fp['what'])}" for i, fp in enumerate(fps))


def _table(head: tuple, rows: list, caps: tuple) -> str:
    """Columns padded to their widest cell, each cut at its cap (``elide``): a row is at most ``WIDTH``."""
    cells = [[elide(str(c), cap, key=i == 0) for i, (c, cap) in enumerate(zip(row, caps))] for row in (head, *rows)]
    return "\n".join(text_table(cells))


def elide(text: str, cap: int, key: bool = False) -> str:
    """``text`` in at most ``cap`` characters: a key loses its middle (``module.…q_proj.weight``: the end
    names the entry), a value its end."""
    if len(text) <= cap:
        return text
    if key:
        keep = cap - 1
        return text[:keep // 3] + "…" + text[len(text) - (keep - keep // 3):]
    return text[:cap - 1] + "…"


def _html(head: str, columns: tuple, rows: list, caps: tuple) -> str:
    """The table as a notebook shows it: each cell on one line, elided by the browser at its column's share
    of ``WIDTH``, the whole cell its hover title."""
    width = sum(caps) + 2 * len(caps)
    cols = "".join(f'<col style="width:{100 * (cap + 2) / width:.1f}%">' for cap in caps)
    cell = ("white-space:nowrap;overflow:hidden;text-overflow:ellipsis;text-align:left;padding:1px 8px 1px 0;"
            "font-family:var(--jp-code-font-family,monospace)")

    def row(values, tag):
        return "<tr>" + "".join(f'<{tag} style="{cell}" title="{html.escape(str(v))}">{html.escape(str(v))}</{tag}>'
                                for v in values) + "</tr>"

    return (f'<div class="nbddp-table" style="max-width:{WIDTH}ch"><div style="white-space:pre-wrap;'
            f'font-family:var(--jp-code-font-family,monospace)">{html.escape(head)}</div>'
            + (f'<table style="table-layout:fixed;width:100%;border-collapse:collapse;margin:2px 0 0 0">{cols}'
               f"<thead>{row(columns, 'th')}</thead><tbody>{''.join(row(r, 'td') for r in rows)}</tbody></table>"
               if rows else "") + "</div>")


def _show(head: str, columns: tuple, rows: list, caps: tuple = WHO_CAPS) -> None:
    """The table as text (a terminal, a log) and as HTML (a notebook), one output."""
    text = head if not rows else head + "\n" + _table(columns, rows, caps)
    from IPython.display import display

    display({"text/plain": text, "text/html": _html(head, columns, rows, caps)}, raw=True)
