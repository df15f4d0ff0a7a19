"""A cell's view: a one-shot cell's dashboard, one slot at the top of its output; a pool cell's one line.

The dashboard (``RunView``) is published when the ranks are forked, before any of their output, so the
stream always runs below it; it is then updated in place by display id (ipyparallel's pattern: it works
in JupyterLab, VS Code and Colab alike, and the saved notebook keeps the last state). Live and final
states are one table in one style, so nothing jumps when the run ends: state, progress (from a rank's
last tqdm record, ``messages.Progress``), time, private memory (USS; RSS and shared on hover), GPU
utilisation and memory on GPUs, and the start of each rank's last line (or its exception). A column no rank has a
figure for is left out. All updates happen on the kernel's main thread, at the supervisor's 1 Hz tick.

A pool cell gets no dashboard of its own (the ``%ddp start`` cell's view follows every rank): one line
(``CellLine``) says what runs, on which ranks, how long and how it ended, always the first of the cell's
outputs: its place reserved as the cell begins, filled at the end of a quick cell, live from the first
tick of a longer one.
"""
from __future__ import annotations

import html
import time

from ..ipy import tracebacks
from ..units import ranks_text, size
from ..wire.messages import Error, Exit, Progress, Ready, Result, Scalars
from . import output
from .iopub import line_bundle, publish_line, unsent
from .metrics_chart import Chart
from .monitor import Monitor, duration
from .output import Slot, text_table
from .relay import latest_redraw
from .theme import FAILED, MUTED, STATES

LAST_CHARS = 160  # of a rank's last line kept (its start: a log dict keeps its first keys)
LINE_BYTES = 4 * LAST_CHARS  # of an unfinished line kept (UTF-8: at most 4 bytes a character)
DUMP_LINES = 64  # lines looked back over for one that is not a stack dump's
# one line a row at any width: every cell keeps to one line, and the last line column takes what is left
# (max-width:0 on a cell of a 100 %-wide table lets it shrink), cut with an ellipsis (its start kept)
TABLE = "border-collapse:collapse;font-size:12px;line-height:1.4;width:100%;table-layout:auto"
CELL = "padding:1px 10px 1px 0;text-align:left;border:none;white-space:nowrap;background:none"
LAST = "width:100%;max-width:0;overflow:hidden;text-overflow:ellipsis;font-family:monospace"


class RunView:
    interval = 1.0

    def __init__(self, live: bool):
        self.live = live  # a Jupyter-like front end: one output updated in place; elsewhere a text summary
        self.handle = None
        self.error: BaseException | None = None
        self.plan = None  # set by begin(); a run that failed before its ranks existed shows nothing

    # -- the launcher's calls, then the supervisor's events ---------------------------------------
    def begin(self, plan, run_dir) -> None:
        self.plan, self.run_dir = plan, run_dir
        self.t0 = time.monotonic()
        self.last_line: dict[int, str] = {}
        self.progress: dict[int, float] = {}  # rank -> its last tqdm fraction
        self.raised: dict[int, str] = {}  # rank -> its exception, "Type: message"
        self.answered: set[int] = set()  # ranks that sent their Result: done, whatever stops them later
        self.copied: dict[int, tuple] = {}  # rank -> (bytes, the notebook names it copied reading them)
        self._current: dict[tuple[int, str], bytes] = {}  # per rank and stream: its unfinished line's start
        self.monitor = Monitor([d for d in plan.device_ids if d is not None])
        self.ended: dict[int, float] = {}
        self.state = {r: "starting" for r in range(plan.world_size)}
        self.pids: dict[int, int] = {}  # pid -> rank
        self.in_debugger: set[int] = set()  # ranks stopped in JupyterLab's debugger panel, at the last tick
        self.chart = Chart()  # what the ranks log (nbddp.log, a bar's postfix), drawn below the table
        if self.live:  # the slot, at the top of the cell's output before any rank writes
            self.handle = Slot()
            self.handle.show(self._bundle())

    def on_Started(self, event) -> None:
        self.monitor.watch(event.rank, event.pid)
        self.pids[event.pid] = event.rank

    def on_Message(self, event) -> None:
        rec, rank = event.record, event.rank
        if type(rec) is Progress:  # its tqdm bar: the progress, and the rank's last line (tqdm's own)
            if rec.fraction is not None:
                self.progress[rank] = rec.fraction
            self.last_line[rank] = rec.line[:LAST_CHARS]
            self.chart.add(rank, rec)
        elif type(rec) is Scalars:
            self.chart.add(rank, rec)
        elif isinstance(rec, Ready) and self.state[rank] == "starting":
            self.state[rank] = "running"
        elif isinstance(rec, Result):
            self.answered.add(rank)
            if rec.copied:  # it copied notebook Python objects as it read them (rank/copywatch.py)
                self.copied[rank] = (rec.copied[0], ", ".join(name for name, _ in rec.copied[1]))
            self._read_unread()
        elif isinstance(rec, Error) and rec.type != "KeyboardInterrupt":
            self.raised.setdefault(rank, f"{rec.type}: {rec.message}".strip().rstrip(":"))
            self._read_unread()
        elif isinstance(rec, Exit) and rec.code not in (0, None):
            self.raised.setdefault(rank, f"exit({rec.code!r})")

    def on_Output(self, event) -> None:
        """The rank's last line, its start (a carriage return redraws it: its latest state); stack dumps
        and blank lines are skipped."""
        key, data = (event.rank, event.stream), event.data
        before = self._current.get(key, b"")  # the start of the line this output goes on with
        end = data.rfind(b"\n")
        current = before + data if end < 0 else data[end + 1:]
        self._current[key] = current if b"\r" in current else current[:LINE_BYTES]
        if b"\r" in current and self._note(event.rank, current):  # an unfinished line counts once redrawn (a
            return  # bar); another may be a stack dump's first bytes ("  File"): it counts once it ends
        for _ in range(DUMP_LINES):  # back over the lines this output ended
            if end < 0:
                return
            start = data.rfind(b"\n", 0, end)
            line = data[start + 1:end] if start >= 0 else before + data[:end]
            if self._note(event.rank, line):
                return
            end = start

    def _note(self, rank: int, line: bytes) -> bool:
        if b"\r" in line:
            line = latest_redraw(line)
        text = line[:LINE_BYTES].decode("utf-8", "replace").rstrip("\r")
        if not text.strip() or tracebacks.DUMP_LINE.match(text):
            return False
        self.last_line[rank] = text[:LAST_CHARS]
        return True

    def on_Exited(self, event) -> None:
        self.exited(event.rank, event.exit)

    def on_Tick(self, event) -> None:
        self.in_debugger = {self.pids[pid] for pid in event.stopped if pid in self.pids}
        self.tick()

    def exited(self, rank: int, exit) -> None:
        if self.plan is None:
            return
        self.monitor.forget(rank)
        self._read_unread()
        s = self.monitor.ranks.get(rank)
        if s is not None and exit.max_rss:
            s.peak_rss = max(s.peak_rss, exit.max_rss)  # the kernel's exact figure (wait4)
        self.ended[rank] = time.monotonic() - self.t0
        if exit.ok or rank in self.answered:  # its work was done (its Result sent) before a peer failed
            self.state[rank] = "finished"
        else:
            self.state[rank] = "stopped" if exit.stopped else "failed"
            if not exit.stopped and rank not in self.raised and exit.code is not None and exit.code < 0:
                self.raised[rank] = f"killed by {_signal_name(-exit.code)}"

    def tick(self) -> None:
        self.monitor.sample()  # (a rank's private memory when its page faults say it moved: monitor.py)
        if self.handle is not None:
            self.handle.update(self._bundle())

    def _read_unread(self) -> None:
        """Once the cell has been sampled (past its first tick), a rank done or leaving has each rank's
        private memory read that no sample reached yet (the samples read the ranks in turn), so the table has
        a figure for every rank; a quick cell, never sampled, pays nothing."""
        if self.monitor.samples:
            self.monitor.read_unread()

    def finish(self, error: BaseException | None) -> None:
        if self.plan is None:
            return
        self.error = error
        self.done = True
        self._read_unread()
        if self.handle is not None:
            self.handle.update(self._bundle())
        else:
            output.current().write("stdout", self._bundle()["text/plain"] + "\n")

    def _bundle(self) -> dict:
        if not self.chart:
            return {"text/html": self.render_html(), "text/plain": self.render_text()}
        return {"text/html": self.render_html() + self.chart.html(),
                "text/plain": self.render_text() + "\n" + self.chart.text()}

    # -- rendering: one table, live and final ---------------------------------------------------------
    done = False

    def _elapsed(self, rank=None) -> float:
        if rank is not None and rank in self.ended:
            return self.ended[rank]
        return time.monotonic() - self.t0

    def status(self) -> str:
        if not self.done:
            return "starting" if set(self.state.values()) == {"starting"} else "running"
        if isinstance(self.error, KeyboardInterrupt):
            return "interrupted"
        return "finished" if set(self.state.values()) == {"finished"} and self.error is None else "failed"

    def title(self) -> str:
        p = self.plan
        return (f"nbddp · {p.world_size} rank{'s' if p.world_size > 1 else ''} · {p.accelerator}/{p.backend}"
                f" · {self.status()} · {self._elapsed():.1f} s")

    def rows(self) -> tuple[list[str], list[dict]]:
        """The header and one row per rank; a column no rank has a figure for is left out."""
        final = self.done
        cols = ["rank", "state"]
        if self.progress:
            cols.append("progress")
        cols.append("time")
        mem = {r: s for r, s in self.monitor.ranks.items() if (s.peak_uss if final else s.uss)}
        if mem or self.copied:
            cols.append("private memory")
        if self.monitor.gpus:
            cols.append("GPU")
        cols.append("last line")
        out = []
        for r in range(self.plan.world_size):
            dev = self.plan.device_ids[r]
            state = self.state[r]
            if state == "running" and final and isinstance(self.error, KeyboardInterrupt):
                state = "interrupted"
            elif state == "running" and not final and r in self.in_debugger:
                state = "in debugger"
            row = {"rank": str(r), "rank:hover": f"cuda:{dev}" if dev is not None else "cpu", "state": state,
                   "time": f"{self._elapsed(r):.1f} s"}
            if r in self.progress:
                row["progress"] = f"{self.progress[r]:.0%}"
            s = mem.get(r)
            if s is not None:  # final: the peak; the rest of RSS is still shared copy-on-write with the notebook
                row["private memory"] = size(s.peak_uss if final else s.uss)
                row["private memory:hover"] = (f"peak: private {size(s.peak_uss)}, RSS {size(s.peak_rss)}" if final else
                                               f"RSS {size(s.rss)}, of which {size(s.shared)} shared copy-on-write")
            if r in self.copied:  # the rank's own figure for the cell: sampling may not have seen it
                grew, names = self.copied[r]
                row["private memory"] = f"{row.get('private memory', '')} +{size(grew)} copied from {names}".strip()
                row["private memory:hover"] = (f"copied reading {names} (Python objects): nbddp.shared({names}) "
                                               "shares it")
            if dev is not None:
                row["GPU"] = self._gpu(dev, final)
            if r in self.raised and state != "finished":
                row["last line"], row["last line:error"] = self.raised[r], "1"
            else:
                row["last line"] = self.last_line.get(r, "")
            out.append(row)
        return cols, out

    def _gpu(self, index: int, final: bool) -> str:
        h = self.monitor.gpus.get(index)
        g = h.last if h else None
        if g is None:
            return ""
        used = h.peak_mem if final else g.mem_used
        util = "" if final or g.util_percent is None else f"{g.util_percent:.0f}% · "
        return f"{util}{size(used)} / {size(g.mem_total)}" + (" peak" if final else "")

    def render_html(self) -> str:
        cols, rows = self.rows()
        esc = html.escape
        head = "".join(f"<th style='{CELL};font-weight:600;color:{MUTED}'>{esc(c)}</th>" for c in cols[:-1])
        head += f"<th style='{CELL};{LAST};font-family:inherit;font-weight:600;color:{MUTED}'>{esc(cols[-1])}</th>"
        body = []
        for row in rows:
            cells = []
            for c in cols:
                value, hover = esc(row.get(c, "")), row.get(c + ":hover")
                style = CELL + (";" + LAST if c == "last line" else "")
                if c == "state":
                    value = f"<span style='color:{STATES.get(row[c], 'inherit')}'>{value}</span>"
                if row.get(c + ":error"):
                    style += f";color:{FAILED}"
                title = f" title='{esc(hover)}'" if hover else (f" title='{value}'" if c == "last line" else "")
                cells.append(f"<td style='{style}'{title}>{value}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        colour = STATES.get(self.status(), "inherit")
        t = self.title().split(" · ")
        t[-2] = f"<span style='color:{colour}'>{t[-2]}</span>"
        # the run directory: on the title's hover always, shown only once a cell failed or was interrupted
        # (where a user goes to read the rest); a <span>, so the view still ends with its only "</div></div>"
        # (notebooks/nbval-sanitize.cfg finds the view by it)
        logs = esc(str(self.run_dir.path))
        shown = (f"<span style='display:block;color:{MUTED}'>logs: {logs}</span>"
                 if self.status() in ("failed", "interrupted") else "")
        return (f"<div class='nbddp-run' style='font-size:12px'><div title='logs: {logs}'><b>nbddp</b> · "
                f"{' · '.join(t[1:])}</div><div><table style='{TABLE}'><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table>{shown}</div></div>")

    def render_text(self) -> str:
        cols, rows = self.rows()
        table = [cols] + [[row.get(c, "") if c != "last line" else _cut(row.get(c, "")) for c in cols]
                          for row in rows]
        lines = [self.title(), *text_table(table)]
        lines.append(f"logs: {self.run_dir.path}")
        return "\n".join(lines)


class CellLine:
    """A pool cell's one line in its own output: what runs, on which ranks, how long, and how it ended.

    The line is the first of the cell's outputs, always: its place is reserved as the cell begins, before
    any rank's text or display (``running``), queued on ipykernel's IO thread without a wake (iopub.py), so a
    quick cell pays next to nothing for it; its final line fills that place (an update, queued the same
    way). A cell past its first second has it live from the pool's first tick (its supervisor's 1 Hz
    ``Tick``): running for how long, each rank's tqdm progress, updated in place by display id (a ``Slot``),
    ending as the final line. Updates never move an output, so the ranks' lines all run below it. The
    pool's own view (the ``%ddp start`` cell) carries the detail."""

    LIVE_RANKS = 4  # ranks named one by one in the live line; beyond, the range of their progress

    def __init__(self, live: bool, what: str = "cell", ranks=None):
        self.live, self.what = live, what
        self.ranks = ranks  # a --ranks cell's ranks (None: every rank of the pool)
        self.plan = None
        self.failed: dict[int, str] = {}
        self.progress: dict[int, float] = {}  # rank -> its last tqdm fraction (live line only)
        self.slot: Slot | None = None  # the line's output (live): its place, reserved as the cell begins
        self.ticked = False  # a tick drew the live line in it
        self.finished = False  # the final line is drawn: ticks after it (a pool's health check) draw nothing
        self.chart = Chart()  # what the ranks log (nbddp.log, a bar's postfix), drawn below the line

    def begin(self, plan, run_dir) -> None:
        """The line's place at the top of the cell's output. Queued without a wake, it goes out before any
        text written after it (ipykernel wakes its IO thread for that text, and sends in order); text this
        notebook cell wrote just before, still unsent, is flushed first."""
        self.plan, self.t0 = plan, time.monotonic()
        if self.live:
            self.slot = Slot("nbddp-line-")
            line = self.head(timed=False) + " · running"
            self.slot.drawn = line_bundle(line)
            publish_line(line, flush=unsent(), display_id=self.slot.display_id)

    def on_Started(self, event) -> None:
        pass

    def on_Message(self, event) -> None:
        rec = event.record
        if type(rec) is Progress:  # a tqdm bar's record
            if rec.fraction is not None:
                self.progress[event.rank] = rec.fraction
            self.chart.add(event.rank, rec)
        elif type(rec) is Scalars:
            self.chart.add(event.rank, rec)
        elif type(rec) is Error or (type(rec) is Exit and rec.code not in (0, None)):
            self.failed.setdefault(event.rank, getattr(rec, "type", "exit"))

    def on_Exited(self, event) -> None:
        self.failed.setdefault(event.rank, "exited")

    def on_Tick(self, event) -> None:
        """The pool's tick while the cell runs (a cell past its first second): the live line, in place."""
        if self.slot is None or self.finished:
            return
        self.ticked = True
        self.slot.update(line_bundle(self.head() + " · running" + self._progress(), self.chart))

    def head(self, timed: bool = True) -> str:
        ranks = ranks_text(self.ranks or range(self.plan.world_size))
        took = f" · {duration(time.monotonic() - self.t0)}" if timed else ""
        return f"nbddp pool · {self.what} on {ranks}{took}"

    def _progress(self) -> str:
        if not self.progress:
            return ""
        if len(self.progress) <= self.LIVE_RANKS:
            return " · " + ", ".join(f"rank {r} {f:.0%}" for r, f in sorted(self.progress.items()))
        low, high = min(self.progress.values()), max(self.progress.values())
        return f" · progress {low:.0%}–{high:.0%}" if high > low else f" · progress {low:.0%}"

    def finish(self, error: BaseException | None) -> None:
        if self.plan is None:
            return
        self.finished = True
        if isinstance(error, KeyboardInterrupt):
            outcome = "interrupted"
        elif self.failed:
            outcome = "failed: " + ", ".join(f"rank {r} {why}" for r, why in sorted(self.failed.items()))
        else:
            outcome = "failed" if error is not None else "ok"
        line = f"{self.head()} · {outcome}"
        if self.ticked:  # the live line ends as the final one, where it is
            self.slot.update(line_bundle(line, self.chart))
        elif self.slot is not None:  # a quick cell's: its place filled, queued as it was reserved
            publish_line(line, flush=False, display_id=self.slot.display_id, update=True, chart=self.chart)
        else:
            output.current().write("stdout", line_bundle(line, self.chart)["text/plain"] + "\n")

def _cut(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
