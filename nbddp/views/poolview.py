"""A pool's dashboard: one output that follows the pool over its whole life.

Shown in the cell that ran ``%ddp start`` (``%ddp status`` shows it again, the same live output): every
rank idle or busy (with the cell it runs and for how long), its memory now and over the pool's life
(RSS; USS, the pages only that rank holds; the rest is still shared copy-on-write with the notebook),
GPU utilisation and memory over the pool's life on GPUs, and the pool's cells with their time and outcome.

It costs a quick cell nothing: while a cell runs it is redrawn at the supervisor's 1 Hz tick (so only
cells longer than a second pay), and between cells on the kernel's own event loop, on the main thread,
every ``REFRESH_S`` (memory sampled, the output updated only when what it shows changed).
"""
from __future__ import annotations

import collections
import dataclasses
import html
import time

from ..units import size
from ..wire.messages import Error, Exit, Progress, Result, Scalars
from .dashboard import CELL
from .metrics_chart import Chart
from .monitor import Monitor, duration, uptime
from .output import Slot, text_table
from .theme import BOX, MUTED, RUNNING, TEXT, WARN

REFRESH_S = 1.0  # between cells: sample and redraw if changed
SERIES_MAX = 512  # points kept per series; past that every other one goes, so the whole life stays
SPARK_WIDTH = 40  # points drawn per series, whatever the pool's age
SPAN_FLOOR = 0.1  # the range drawn spans at least this fraction of the highest value
MEMORY_FLOOR = 16 * 2**20  # a memory series' range drawn spans at least this (bytes)
LINE_STEP_PX, LINE_HEIGHT_PX = 4, 14  # each point's width and the line's box height in the HTML view
CELLS_SHOWN = 8
EVENTS_SHOWN = 6  # a pool's last losses and mendings, each with its time
BARS = "▁▂▃▄▅▆▇█"
SMALL_TABLE = "border-collapse:collapse;font-size:12px;line-height:1.4"


class LifeSeries:
    """Samples over the pool's life in bounded memory (when full, every other point is dropped), drawn as a
    fixed number of points whatever the pool's age, so the view keeps one width from its first minute to its
    tenth hour."""

    def __init__(self):
        self.values: list[float] = []

    def add(self, value: float) -> None:
        self.values.append(value)
        if len(self.values) > SERIES_MAX:
            self.values = self.values[::2]

    def points(self, n: int = SPARK_WIDTH) -> list[float]:
        """Exactly ``n`` points over the pool's life: each the highest value of its stretch of time (a young
        pool's few samples stretched across)."""
        vals = self.values
        if not vals:
            return []
        return [max(vals[i * len(vals) // n:max(i * len(vals) // n + 1, (i + 1) * len(vals) // n)]) for i in range(n)]

    def scale(self, floor: float = 0.0) -> tuple[float, float]:
        """The range drawn: lowest to highest value, at least ``floor`` and ``SPAN_FLOOR`` of the highest wide
        (around the middle), so a near-flat series draws as a flat line, not as noise blown up to full scale."""
        low, high = min(self.values), max(self.values)
        span = max(floor, SPAN_FLOOR * abs(high))
        if high - low < span:
            mid = (high + low) / 2
            low, high = mid - span / 2, mid + span / 2
        return low, high

    def spark(self, scale: tuple[float, float] | None = None) -> str:
        """SPARK_WIDTH characters between ``scale`` (low, high), or ``scale()``."""
        if not self.values:
            return ""
        low, high = scale or self.scale()
        span = (high - low) or 1.0
        return "".join(BARS[max(0, min(len(BARS) - 1, int((v - low) / span * len(BARS))))] for v in self.points())

    def line_html(self, scale: tuple[float, float] | None = None, colour: str = RUNNING) -> str:
        """The same points as a thin line (a 2 px top edge per point) in a box of fixed size."""
        if not self.values:
            return ""
        low, high = scale or self.scale()
        span = (high - low) or 1.0
        heights = [2 + round(max(0.0, min(1.0, (v - low) / span)) * (LINE_HEIGHT_PX - 2)) for v in self.points()]
        cells = "".join(
            f"<span style='display:inline-block;width:{LINE_STEP_PX}px;height:{h}px;"
            f"border-top:2px solid {colour};box-sizing:border-box'></span>" for h in heights)
        return (f"<span class='nbddp-life' style='display:inline-flex;align-items:flex-end;vertical-align:middle;"
                f"width:{SPARK_WIDTH * LINE_STEP_PX}px;height:{LINE_HEIGHT_PX}px;background:{BOX}'>{cells}</span>")


class LifeCell(str):
    """A table cell drawing a series: its text form, with its HTML form (``html``) beside."""

    def __new__(cls, text: str, html_text: str):
        cell = super().__new__(cls, text)
        cell.html = html_text
        return cell


class PoolView:
    """Subscribes to the pool's supervisor events during cells; the pool calls the rest."""

    interval = 1.0  # the tick a cell's supervisor loop gives it

    def __init__(self, plan, run_dir, *, shown: bool):
        self.plan, self.run_dir = plan, run_dir
        self.shown = shown  # a Jupyter-like session: one output, updated in place by display id
        self.slot = Slot("nbddp-pool-")  # one output: every copy shown (%ddp status) stays live
        self.monitor = Monitor([d for d in plan.device_ids if d is not None])
        self.started = time.time()
        self.rss = {r: LifeSeries() for r in range(plan.world_size)}
        self.gpu_util = {i: LifeSeries() for i in self.monitor.gpus}
        self.gpu_mem = {i: LifeSeries() for i in self.monitor.gpus}
        self.state = {r: "idle" for r in range(plan.world_size)}
        self.pids: dict[int, int] = {}
        self.nodes: dict[int, str] = {}  # a pool across nodes (--cluster): rank -> its node, as the device column says
        self.cells: collections.deque = collections.deque(maxlen=CELLS_SHOWN)  # (label, seconds, outcome)
        self.cells_run = 0
        self.running: str | None = None
        self.cell_t0 = 0.0
        self.ended: str | None = None
        self._timer = None
        self.steps = Chart()  # the running cell's step times (its logged steps, its bars): the slow rank
        self.events: collections.deque = collections.deque(maxlen=EVENTS_SHOWN)  # (time, what): lost, healed

    # -- the pool's calls ---------------------------------------------------------------------------
    def watch(self, rank: int, pid: int) -> None:
        self.pids[rank] = pid
        self.monitor.watch(rank, pid)

    def show(self) -> None:
        """Display the view in the current cell (``%ddp start``, ``%ddp status``): the same output id,
        so every copy stays live."""
        self.sample(uss=True)
        if self.shown:
            self._publish(update=False)
            if self._timer is None:
                self._schedule()

    def said(self, text: str, at: float | None = None, mending: bool = False) -> None:
        """A moment of the pool's life (a rank lost, the pool healing, healed), with its time: shown at once.
        ``mending``: the pool begins to mend its lost ranks (their rows say so)."""
        self.events.append((at or time.time(), text))
        if mending:
            for r, s in self.state.items():
                self.state[r] = "healing" if s == "dead" else s
        self.redraw()

    def on_Moved(self, event) -> None:
        """The pool's ranks moved (a shrink, a resize: supervisor.Moved), onto ``event.device_ids``."""
        self.renumber(event.moves, dataclasses.replace(self.plan, device_ids=event.device_ids))

    def renumber(self, moves: dict, plan) -> None:
        """The pool shrank or grew: rank ``old`` is rank ``moves[old]`` from now on, and ``plan`` says its ranks."""
        self.plan = plan
        self.rss = {moves[r]: s for r, s in self.rss.items() if r in moves}
        self.state = {moves[r]: s for r, s in self.state.items() if r in moves}
        for r in range(plan.world_size):  # ranks added
            self.rss.setdefault(r, LifeSeries())
            self.state.setdefault(r, "starting")
        self.pids = {moves[r]: pid for r, pid in self.pids.items() if r in moves}
        self.nodes = {moves[r]: n for r, n in self.nodes.items() if r in moves}
        self.monitor.renumber(moves)

    def cell_began(self, label: str) -> None:
        self.running, self.cell_t0 = label, time.monotonic()
        self.steps = Chart()
        for r, s in self.state.items():
            if s != "dead":
                self.state[r] = "busy"

    def cell_ended(self, outcome: str) -> None:
        self.cells.append((self.running or "", time.monotonic() - self.cell_t0, outcome))
        self.cells_run += 1
        self.running = None
        self.steps = Chart()  # (a slow rank is named while it lasts)
        for r, s in self.state.items():
            if s == "busy":
                self.state[r] = "idle"

    def finish(self, why: str, live_as: str = "ended") -> None:
        """The pool ended here (stopped, torn down, a rank died; detached: its ranks ``live_as`` "kept"): the last
        drawing stays in the notebook."""
        if self.ended is not None:
            return
        self.ended, self.ended_at = why, time.time()
        # asked to (each rank left the group and exited), or ended otherwise: no rank is idle any more
        self.state = {r: "stopped" if why == "stopped" else ("dead" if s == "dead" else live_as)
                      for r, s in self.state.items()}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.slot.drawn is not None:  # it was shown: its last state stays in the notebook
            self._publish(update=True)

    # -- supervisor events during a cell ------------------------------------------------------------
    def on_Started(self, event) -> None:
        self.watch(event.rank, event.pid)
        if self.state.get(event.rank) in ("dead", "healing", "starting"):  # a replacement, or a rank added
            self.state[event.rank] = "idle"

    def on_Message(self, event) -> None:
        if isinstance(event.record, (Result, Error, Exit)) and self.state.get(event.rank) == "busy":
            self.state[event.rank] = "idle"
        elif type(event.record) in (Scalars, Progress):
            self.steps.add(event.rank, event.record)

    def on_Exited(self, event) -> None:
        self.state[event.rank] = "dead"
        self.monitor.forget(event.rank)

    def on_Tick(self, event) -> None:
        self.redraw()

    # -- sampling and drawing -----------------------------------------------------------------------
    def sample(self, uss: bool = False) -> None:
        """Memory now (USS of every rank when ``uss``; else each rank's in turn, monitor.py)."""
        self.monitor.sample(force=uss)
        for r in self.monitor.lost:  # died between cells: the pool learns how at its next cell
            self.state[r] = "dead"
        for r, s in self.monitor.ranks.items():
            if self.state.get(r) != "dead":
                self.rss[r].add(s.rss)
        for i, h in self.monitor.gpus.items():
            if h.last is not None:
                self.gpu_util[i].add(h.last.util_percent or 0.0)
                self.gpu_mem[i].add(h.last.mem_used or 0)

    def redraw(self) -> None:
        self.sample()
        if self.shown and self.ended is None:
            self._publish(update=True)

    def _schedule(self) -> None:
        import asyncio

        try:
            loop = asyncio.get_running_loop()  # the kernel's: callbacks run between cells, on this thread
        except RuntimeError:
            return  # no event loop (a script): the view is drawn at ticks and at the end only
        self._timer = loop.call_later(REFRESH_S, self._between_cells)

    def _between_cells(self) -> None:
        self._timer = None
        if self.ended is not None:
            return
        if self.running is None:
            self.redraw()
        self._schedule()

    def _publish(self, update: bool) -> None:
        bundle = {"text/html": self.render_html(), "text/plain": self.render_text()}
        if update:
            self.slot.update(bundle)
        else:
            self.slot.show(bundle)

    # -- rendering ----------------------------------------------------------------------------------
    def title(self) -> str:
        p = self.plan
        up = (f"was up {uptime(self.ended_at - self.started)}" if self.ended
              else f"up {uptime(time.time() - self.started)}")
        state = self.ended or (f"running {self.running}" if self.running else "idle")
        return (f"nbddp pool · {p.world_size} rank{'' if p.world_size == 1 else 's'} · {p.accelerator}/{p.backend} · "
                f"{state} · {up} · "
                f"{self.cells_run} cell{'' if self.cells_run == 1 else 's'} run")

    def rows(self) -> list[list[str]]:
        """One row per rank; an ended pool's processes hold no memory now: only its history is shown."""
        if self.ended is not None:
            rows = [["rank", "pid", "device", "state", "RSS over the pool's life"]]
            for r in range(self.plan.world_size):
                dev = self.plan.device_ids[r]
                rows.append([str(r), str(self.pids.get(r, "-")), self._device(r, dev), self.state[r],
                             self._life(self.rss[r])])
            return rows
        rows = [["rank", "pid", "device", "state", "RSS", "USS (private)", "RSS over the pool's life"]]
        for r in range(self.plan.world_size):
            s = self.monitor.ranks.get(r)
            dev = self.plan.device_ids[r]
            state = self.state[r]
            if state == "busy" and self.running:
                state = f"busy: {self.running} {time.monotonic() - self.cell_t0:.0f} s"
            rows.append([str(r), str(self.pids.get(r, "-")), self._device(r, dev), state, size(s.rss) if s else "-",
                         size(s.uss) if s and s.uss else "-", self._life(self.rss[r])])
        return rows

    def _device(self, rank: int, dev) -> str:
        where = f"cuda:{dev}" if dev is not None else "cpu"
        return f"{where} {self.nodes[rank]}" if rank in self.nodes else where

    @staticmethod
    def _life(series: LifeSeries, scale: tuple[float, float] | None = None, figures: bool = True) -> str:
        """The series over the pool's life (its range at least ``MEMORY_FLOOR`` wide), then its lowest and
        highest figure; a ``LifeCell``: the text, with its HTML (a thin line) beside."""
        if not series.values:
            return ""
        scale = scale or series.scale(MEMORY_FLOOR)
        figures_text = f" {size(min(series.values))}–{size(max(series.values))}" if figures else ""
        return LifeCell(series.spark(scale) + figures_text, series.line_html(scale) + html.escape(figures_text))

    def gpu_rows(self) -> list[list[str]]:
        if not self.gpu_util:
            return []
        rows = [["GPU", "util over the pool's life", "memory over the pool's life"]]
        for i in self.gpu_util:
            rows.append([f"cuda:{i}", self._life(self.gpu_util[i], scale=(0.0, 100.0), figures=False),
                         self._life(self.gpu_mem[i])])
        return rows

    def cell_rows(self) -> list[str]:
        return [f"{label} · {duration(sec)} · {outcome}" for label, sec, outcome in self.cells]

    def event_lines(self) -> list[str]:
        return [f"{time.strftime('%H:%M:%S', time.localtime(at))} {text}" for at, text in self.events]

    def render_text(self) -> str:
        lines = [self.title()]
        for table in (self.rows(), self.gpu_rows()):
            lines += text_table(table)
        if self.cells:
            lines.append("cells: " + "; ".join(self.cell_rows()))
        if slow := self.steps.slow():
            lines.append(f"slow: {slow}")
        lines += self.event_lines()
        lines.append(f"logs: {self.run_dir.path}")
        return "\n".join(lines)

    def render_html(self) -> str:
        """The dashboard's style (dashboard.py): small, one line a row at any width."""
        def table(rows):
            head = "".join(f"<th style='{CELL};font-weight:600;color:{MUTED}'>{html.escape(c)}</th>" for c in rows[0])
            body = "".join("<tr>" + "".join(f"<td style='{CELL}'>"
                                            f"{c.html if isinstance(c, LifeCell) else html.escape(c)}</td>"
                                            for c in r) + "</tr>" for r in rows[1:])
            return f"<table style='{SMALL_TABLE}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        parts = [f"<div class='nbddp-pool' style='font-size:12px'><div><b>{html.escape(self.title())}</b></div>",
                 table(self.rows())]
        if self.gpu_util:
            parts.append(table(self.gpu_rows()))
        if self.cells:
            cell_lines = "<br>".join(html.escape(c) for c in self.cell_rows())
            parts.append(f"<div style='color:{TEXT}'>{cell_lines}</div>")
        if slow := self.steps.slow():
            parts.append(f"<div style='color:{WARN}'>slow: {html.escape(slow)}</div>")
        parts += [f"<div style='color:{WARN}'>{html.escape(line)}</div>" for line in self.event_lines()]
        parts.append(f"<div style='color:{MUTED}'>logs: {html.escape(str(self.run_dir.path))}</div></div>")
        return "".join(parts)

