"""``--profile``'s picture in the cell: a stacked horizontal bar per rank (compute, communication, of which
waiting for other ranks, data loading, other; one length per second, so a longer bar is a slower rank), the
line that names the straggler, and where each rank's trace is. Inline SVG in HTML: text and axes in
``currentColor``, the segments in mid-saturation colours that read on a light page and a dark one, the empty
track in the theme's border grey (a CSS variable: in ``style``, never in a presentation attribute); a ``text/plain``
table for the rest."""
from __future__ import annotations

import html

from . import output
from .output import text_table
from .theme import MUTED, TRACK

# (column, label, colour): the order of the segments in a bar; "comm" is communication less its waiting
SEGMENTS = (("compute_s", "compute", "#4e79a7"), ("comm", "communication", "#59a14f"),
            ("wait_s", "waiting for other ranks", "#e8853a"), ("data_s", "data loading", "#b07aa1"),
            ("other_s", "other", "#9a9a9a"))
BAR_W, LABEL_W, ROW_H, BAR_H = 420, 64, 22, 14


def parts(row: dict) -> dict:
    """The bar's segments of a rank's row, in seconds (communication less its waiting)."""
    return {"compute_s": row["compute_s"], "comm": max(0.0, row["comm_s"] - row["wait_s"]), "wait_s": row["wait_s"],
            "data_s": row["data_s"], "other_s": row["other_s"]}


def show(profile) -> None:
    """The bars in the cell; if no rank profiled anything, only why (one line, said once for all ranks alike)."""
    if profile.rows:
        output.current().display(bundle(profile), {}, None)
        return
    whys = sorted({p.split(": ", 1)[-1] for p in profile.problems})
    text = whys[0] if len(whys) == 1 else "; ".join(profile.problems)
    output.current().write("stderr", f"nbddp: --profile: {text}\n")


def bundle(profile) -> dict:
    return {"text/plain": text(profile), "text/html": page(profile)}


def _title(profile) -> str:
    steps = sorted({row["steps"] for row in profile.rows})
    n = "/".join(map(str, steps)) or "0"
    short = f" (of {profile.asked} asked: the cell ended first)" if steps and profile.asked > max(steps) else ""
    return f"nbddp profile · {len(profile.rows)} rank(s) · {n} step(s){short}"


def text(profile) -> str:
    rows = [["rank", "step s", "compute s", "comm s", "of which wait s", "data s", "other s"]]
    for row in profile.rows:
        rows.append([str(row["rank"])] + [f"{row[c]:.3f}" for c in ("step_s", "compute_s", "comm_s", "wait_s",
                                                                     "data_s", "other_s")])
    lines = [_title(profile)] + (text_table(rows) if profile.rows else [])
    lines += [profile.verdict] if profile.verdict else []
    lines += [f"({p})" for p in profile.problems]
    lines += [f"trace: {t}" for t in profile.traces]
    return "\n".join(lines)


def page(profile) -> str:
    longest = max((row["step_s"] for row in profile.rows), default=0.0) or 1.0
    scale = BAR_W / longest
    height = ROW_H * len(profile.rows) + 18
    svg = [(f"<svg xmlns='http://www.w3.org/2000/svg' width='{LABEL_W + BAR_W + 70}' height='{height}' "
            "style='color:inherit;font:12px sans-serif' role='img' aria-label='time per rank'>")]
    for i, row in enumerate(profile.rows):
        y = i * ROW_H
        svg.append(f"<text x='0' y='{y + BAR_H - 2}' fill='currentColor'>rank {row['rank']}</text>")
        svg.append(f"<rect x='{LABEL_W}' y='{y}' width='{BAR_W}' height='{BAR_H}' style='fill:{TRACK}'/>")
        x = float(LABEL_W)
        for col, label, colour in SEGMENTS:
            seconds = parts(row)[col]
            w = seconds * scale
            if w <= 0:
                continue
            svg.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{BAR_H}' style='fill:{colour}'>"
                       f"<title>rank {row['rank']}: {label} {seconds:.3f} s</title></rect>")
            x += w
        svg.append(f"<text x='{LABEL_W + BAR_W + 6}' y='{y + BAR_H - 2}' fill='currentColor'>"
                   f"{row['step_s']:.2f} s</text>")
    axis_y = ROW_H * len(profile.rows)
    svg.append(f"<line x1='{LABEL_W}' y1='{axis_y}' x2='{LABEL_W + BAR_W}' y2='{axis_y}' stroke='currentColor' "
               "stroke-opacity='0.5'/>")
    svg.append(f"<text x='{LABEL_W}' y='{axis_y + 14}' fill='currentColor' fill-opacity='0.7'>0 s</text>")
    svg.append(f"<text x='{LABEL_W + BAR_W}' y='{axis_y + 14}' fill='currentColor' fill-opacity='0.7' "
               f"text-anchor='end'>{longest:.2f} s</text></svg>")
    legend = " ".join(f"<span style='white-space:nowrap'><span style='display:inline-block;width:10px;height:10px;"
                      f"background:{colour};margin:0 4px 0 10px'></span>{html.escape(label)}</span>"
                      for _, label, colour in SEGMENTS)
    out = ["<div class='nbddp-profile' style='color:inherit;font-size:12px'><div "
           f"style='color:{MUTED}'>{html.escape(_title(profile))}</div>"]
    if profile.rows:
        out += ["".join(svg), f"<div>{legend}</div>"]
    if profile.verdict:
        out.append(f"<div style='margin-top:4px'><b>{html.escape(profile.verdict)}</b></div>")
    out += [f"<div style='color:{MUTED}'>({html.escape(p)})</div>" for p in profile.problems]
    out += [f"<div style='color:{MUTED}'>trace: {html.escape(t)}</div>" for t in profile.traces]
    return "".join(out) + "</div>"
