"""Charts of what the ranks log: one panel per scalar, one line per rank, and the slow rank named.

A ``Chart`` is fed the cell's ``messages.Scalars`` (``nbddp.log``) and the numbers of its tqdm bars'
postfixes (``logged``); the cell's dashboard (dashboard.py: ``RunView`` for a one-shot cell, ``CellLine``
for a pool's) draws it into its own output at its tick (at most twice a second) and once more at the end,
so the saved notebook keeps a static chart (inline SVG in the HTML: no script, no kernel needed to see it).

Each series keeps at most ``MAX_POINTS`` points however long the training: past that it keeps every
other one (and always the last), so a redraw costs the same at step 100 and at step 10 million. Past
``MAX_LINES`` ranks a panel draws their median, a band from their minimum to their maximum, and the ranks
whose latest value lies farthest out (``OUTLIERS``). Colours read in light and dark themes (theme.py);
text and axes take the output's own colour.

The slow rank (``slow_rank``): each rank's recent step time, from its last ``RATE_STEPS`` logged steps or
its bar's rate; a rank at least ``SLOW_RATIO`` times the median (and ``SLOW_GAP_S`` more) is named while it lasts.
"""
from __future__ import annotations

import html
import math
import statistics

from ..wire.messages import Progress, Scalars
from .theme import MUTED, SERIES, TRACK, WARN

MAX_POINTS = 1024  # kept per series (rank, name)
MAX_LINES = 8  # ranks drawn one line each; beyond, median, band and outliers
OUTLIERS = 3
SLOW_RATIO = 1.25
SLOW_GAP_S = 0.005  # and this much slower a step: microsecond steps' jitter names no one
RATE_STEPS = 20  # recent logged steps a rank's step time is measured over
WIDTH, HEIGHT, PANELS_PER_ROW = 300, 150, 3
LEFT, RIGHT, TOP, BOTTOM = 46, 8, 20, 26  # the plot's margins in a panel (axis labels, legend)


def logged(rank: int, record, bars: dict) -> Scalars | None:
    """What a rank's record logs: its ``Scalars``; a tqdm bar's postfix numbers as one row at the bar's step
    (``bars``: (rank, bar) -> the last step taken, so a redraw at the same step adds nothing)."""
    if type(record) is Scalars:
        return record
    if type(record) is Progress and (scalars := record.scalars):
        step, key = record.state.get("n") or 0, (rank, record.bar)
        if bars.get(key) == step:
            return None
        bars[key] = step
        import time

        return Scalars((step,), (time.time(),), {name: (value,) for name, value in scalars.items()})
    return None


class Series:
    """One rank's values of one name: at most ``MAX_POINTS`` (step, value), every ``stride``-th kept."""

    def __init__(self):
        self.steps: list = []
        self.values: list = []
        self.stride, self.seen = 1, 0
        self.last: tuple | None = None

    def extend(self, steps, values) -> None:
        """A batch of points (NaN: not logged at that step), every ``stride``-th kept: slices, not a loop per
        point (ranks logging 10,000 calls a second each cost the kernel's view next to nothing)."""
        if not all(math.isfinite(v) for v in values):  # (NaN: not logged at that step; an infinity: not drawable)
            pairs = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
            steps, values = [p[0] for p in pairs], [p[1] for p in pairs]
        if not steps:
            return
        self.last = (steps[-1], values[-1])
        first = (-self.seen) % self.stride
        self.steps.extend(steps[first::self.stride])
        self.values.extend(values[first::self.stride])
        self.seen += len(steps)
        while len(self.steps) > MAX_POINTS:
            del self.steps[1::2], self.values[1::2]
            self.stride *= 2

    def points(self) -> list[tuple]:
        pts = list(zip(self.steps, self.values))
        if self.last is not None and (not pts or pts[-1] != self.last):
            pts.append(self.last)
        return pts


class Chart:
    """What a cell's ranks logged, to draw. ``add(rank, record)`` for each of their records."""

    def __init__(self):
        self.series: dict[str, dict[int, Series]] = {}  # name -> rank -> its series
        self.bars: dict = {}
        self.recent: dict[int, list] = {}  # rank -> (step, time) of its last RATE_STEPS logged steps
        self.bar_rates: dict[tuple, float] = {}  # (rank, bar) -> seconds a step, from the bar's rate

    def add(self, rank: int, record) -> None:
        if type(record) is Progress and record.state.get("rate"):
            self.bar_rates[(rank, record.bar)] = 1.0 / record.state["rate"]
        rec = logged(rank, record, self.bars)
        if rec is None:
            return
        for name, column in rec.values.items():
            self.series.setdefault(name, {}).setdefault(rank, Series()).extend(rec.steps, column)
        if type(record) is not Scalars:  # (a bar's postfix: its rate already says its pace)
            return
        recent = self.recent.setdefault(rank, [])
        for step, when in zip(rec.steps[-RATE_STEPS:], rec.times[-RATE_STEPS:]):
            if not recent or step != recent[-1][0]:
                recent.append((step, when))
        del recent[:-RATE_STEPS]

    def __bool__(self) -> bool:
        """Something to draw: a scalar logged, or a slow rank to name."""
        return bool(self.series) or self.slow() is not None

    # -- the slow rank ------------------------------------------------------------------------------
    def step_times(self) -> dict[int, float]:
        """Each rank's recent seconds a step: from its logged steps, else its bar's rate."""
        times: dict[int, float] = {}
        for (rank, _bar), seconds in list(self.bar_rates.items()):  # a rank's fastest bar: its innermost (batches)
            times[rank] = min(seconds, times.get(rank, seconds))
        for rank, recent in list(self.recent.items()):
            if len(recent) >= 3 and recent[-1][0] != recent[0][0]:
                times[rank] = (recent[-1][1] - recent[0][1]) / abs(recent[-1][0] - recent[0][0])
        return times

    def slow(self) -> str | None:
        return slow_rank(self.step_times())

    # -- drawing --------------------------------------------------------------------------------------
    def html(self) -> str:
        """The charts (HTML); never an exception: a drawing that fails leaves the cell's view as it was."""
        return _drawn(self._html)

    def text(self) -> str:
        """One line per scalar: each rank's latest value, at its step (never an exception: no line)."""
        return _drawn(self._text)

    def _html(self) -> str:
        if not self:
            return ""
        panels = "".join(_panel(name, ranks) for name, ranks in self.series.items())
        slow = self.slow()
        said = f"<div style='color:{WARN};margin:2px 0'>{html.escape(slow)}</div>" if slow else ""
        return (f"<div class='nbddp-charts' style='margin-top:4px'>{said}<div style='display:flex;flex-wrap:wrap;"
                f"gap:6px'>{panels}</div></div>")

    def _text(self) -> str:
        lines = []
        slow = self.slow()
        if slow:
            lines.append(slow)
        for name, ranks in self.series.items():
            lasts = {r: s.last for r, s in sorted(ranks.items()) if s.last is not None}
            if len(lasts) > MAX_LINES:
                values = [v for _, v in lasts.values()]
                said = f"median {_num(statistics.median(values))}, {_num(min(values))} to {_num(max(values))}"
            else:
                said = " · ".join(f"rank {r} {_num(v)} (step {s})" for r, (s, v) in lasts.items())
            lines.append(f"{name}: {said}")
        return "\n".join(lines)


def _drawn(draw) -> str:
    """``draw()``, or "" where it fails (no chart, no line)."""
    try:
        return draw()
    except Exception:  # noqa: BLE001 - the view is the user's window on the training: a drawing must not end it
        return ""


def slow_rank(step_times: dict[int, float]) -> str | None:
    """"rank 1: 1.6× the median step time" for the slowest rank at least ``SLOW_RATIO`` times the median
    of every rank's (two ranks or more), else None."""
    if len(step_times) < 2:
        return None
    median = statistics.median(step_times.values())
    rank, slowest = max(step_times.items(), key=lambda item: item[1])
    if median <= 0 or slowest < SLOW_RATIO * median or slowest - median < SLOW_GAP_S:
        return None
    return (f"rank {rank}: {slowest / median:.1f}× the median step time ({_seconds(slowest)} a step, "
            f"median {_seconds(median)})")


def _panel(name: str, ranks: dict[int, Series]) -> str:
    """One scalar's panel: an inline SVG, its axes labelled with the step and the value."""
    lines = _lines(ranks)
    pts = [p for _, _, points in lines for p in points]
    if not pts:
        return ""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def xy(p) -> str:
        return f"{LEFT + (p[0] - x0) / (x1 - x0) * w:.1f},{TOP + (1 - (p[1] - y0) / (y1 - y0)) * h:.1f}"

    parts = [f"<rect x='{LEFT}' y='{TOP}' width='{w}' height='{h}' style='fill:none;stroke:{TRACK}'/>"]
    for tick in _ticks(y0, y1):
        y = TOP + (1 - (tick - y0) / (y1 - y0)) * h
        parts.append(f"<line x1='{LEFT}' x2='{LEFT + w}' y1='{y:.1f}' y2='{y:.1f}' style='stroke:{TRACK}'/>"
                     f"<text x='{LEFT - 4}' y='{y + 3:.1f}' text-anchor='end'>{_num(tick)}</text>")
    for tick in _ticks(x0, x1):
        x = LEFT + (tick - x0) / (x1 - x0) * w
        parts.append(f"<text x='{x:.1f}' y='{TOP + h + 12}' text-anchor='middle'>{_num(tick)}</text>")
    parts.append(f"<text x='{LEFT + w / 2}' y='{HEIGHT - 3}' text-anchor='middle' style='fill:{MUTED}'>step</text>")
    legend = []
    for label, colour, points in lines:
        if label == "band":
            lo = " ".join(xy((s, a)) for s, a, _ in points)
            hi = " ".join(xy((s, b)) for s, _, b in reversed(points))
            parts.append(f"<polygon points='{lo} {hi}' style='fill:{colour};opacity:0.25;stroke:none'/>")
            continue
        parts.append(f"<polyline points='{' '.join(map(xy, points))}' style='fill:none;stroke:{colour};"
                     "stroke-width:1.5;stroke-linejoin:round'/>")
        legend.append((label, colour))
    x = LEFT
    for label, colour in legend:
        parts.append(f"<text x='{x}' y='{TOP - 6}' style='fill:{colour}'>{html.escape(label)}</text>")
        x += 7 * len(label) + 10
    title = html.escape(name)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' role='img' "
            f"aria-label='{title} by step' style='font:10px sans-serif;fill:currentColor;overflow:visible'>"
            f"<text x='{WIDTH - RIGHT}' y='{TOP - 6}' text-anchor='end' style='font-weight:600'>{title}</text>"
            f"{''.join(parts)}</svg>")


def _lines(ranks: dict[int, Series]) -> list[tuple]:
    """(label, colour, points) to draw: a line per rank, or past ``MAX_LINES`` ranks the median, the band
    (points: (step, low, high)) and the outlying ranks."""
    if len(ranks) <= MAX_LINES:
        return [(f"rank {r}", SERIES[r % len(SERIES)], s.points()) for r, s in sorted(ranks.items())]
    by_step: dict = {}
    for s in ranks.values():
        for step, value in s.points():
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    band = [(st, min(by_step[st]), max(by_step[st])) for st in steps]
    median = [(st, statistics.median(by_step[st])) for st in steps]
    lasts = {r: s.last[1] for r, s in ranks.items() if s.last is not None}
    mid = statistics.median(lasts.values())
    far = sorted(lasts, key=lambda r: abs(lasts[r] - mid), reverse=True)[:OUTLIERS]
    return [("band", SERIES[0], band), (f"median of {len(ranks)} ranks", SERIES[0], median),
            *[(f"rank {r}", SERIES[1 + i], ranks[r].points()) for i, r in enumerate(sorted(far))]]


def _ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """Round values between ``lo`` and ``hi`` (1, 2 or 5 times a power of ten apart)."""
    span = hi - lo
    raw = span / count
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _num(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.2g}"
    return f"{value:.4g}"


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"
