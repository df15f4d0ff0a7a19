"""Rank output -> the cell: whole, rank-prefixed lines and rich displays, in order per rank, never fragmented.

The relay subscribes to the supervisor's events: raw bytes as they arrive on each rank's stdout/stderr
pipe, which it cuts at newlines (keeping partial lines until they are complete, a carriage-return redraw
as its latest state), and the displays a rank sends on its channel, before which that rank's pending
text is flushed. It hands both to a sink (the cell). The rank's log file (kernel/ranks/logs.py) keeps every
byte, so nothing is lost when the cell trims output.

A line every rank prints identically is shown once, labelled with the ranks (``[rank0-1]:``): with the
prefix on and more than one rank shown, each rank's lines wait up to ``MERGE_S`` for the same line from
the others (``Merger``); lines that differ are shown per rank, each rank's in its order.

A rank's tqdm bar (``tqdm.auto``, ``tqdm.notebook``, ``tqdm.std``) arrives as ``messages.Progress``
records, tqdm's own state, never as text: it is shown as a progress bar, labelled with the rank, updated in
place by display id (``Bars``): every rank's n-th bar in one output, in rank order, kept at the last state
its rank sent however the cell ends (a stack dump holds back text, never records), with tqdm's text line as
its text/plain twin; the rank's log keeps that line (kernel/ranks/logs.py). A bar without a total (nothing to
fill) is a line, its last state, as tqdm's text was. A line redrawn with carriage returns that is not tqdm's
(``print(f"\\r{i}", end="")``) is text: shown as a line, its latest state.
"""
from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

from ..units import rank_span
from ..wire import messages
from ..wire.budget import Budget
from . import output
from .theme import DONE, RUNNING, TRACK, WARN

MAX_PARTIAL = 1 << 20  # bytes of an unfinished line kept per rank and stream
MERGE_S = 0.3  # how long a rank's line waits for the same line from the other ranks
BAR_EVERY_S = 0.2  # a bar is redrawn in the cell at most this often (its group's last state at once)
BAR_GATHER_S = 0.5  # a new group of bars waits this long at most for every rank's bar, to show them in rank order
BAR_KEEP = 64  # groups of bars kept, complete and shown, that a rank drawing no bar yet might still add to


class CellSink:
    """Where relayed output goes: the parent's stdout/stderr (the cell, in a kernel) and, for rich
    outputs, the kernel's display publisher. Each rank's displays get display ids of their own, so a
    rank's ``clear_output()`` clears only what that rank showed, and its display-id updates reach the
    right output. Outside a kernel a display prints its text/plain form."""

    def __init__(self, run_id: str = "nbddp"):
        self.run_id = run_id
        self._shown: dict[int, list[str]] = {}  # rank -> ids of the outputs it occupies, in order
        self._free: dict[int, list[str]] = {}  # rank -> cleared outputs, reused by its next displays
        self._clear_pending: set[int] = set()  # clear_output(wait=True): clear at the next display
        self._alias: dict[tuple[int, str], str] = {}  # (rank, the rank's display id) -> ours
        self._count = 0
        self._last: dict[int | None, str] = {}  # rank -> the stream its text went to last
        self._order_budget = Budget()  # ipykernel's flush waits for its IO thread: ~0.6 ms here

    def write(self, stream: str, text: str, rank: int | None = None) -> None:
        """The kernel's stdout and stderr each send on their own schedule (ipykernel: 0.2 s after a
        write): when a rank's text changes stream, the other stream's is sent first, within the budget."""
        last = self._last.get(rank, stream)
        if last != stream and self._order_budget.take():
            output.current().flush(last)
        self._last[rank] = stream
        output.current().write(stream, text)

    def display(self, rank: int, rec, label: str | None) -> None:
        publish = _publisher()
        if publish is None:
            text = rec.data.get("text/plain")
            if text:
                self.write("stdout", (label + "\n" if label else "") + text + "\n", rank)
            return
        if rec.update:
            target = self._alias.get((rank, rec.display_id))
            if target is not None:
                publish(rec.data, rec.metadata, transient={"display_id": target}, update=True)
            return
        if rank in self._clear_pending:
            self._clear_pending.discard(rank)
            self._free[rank] = self._free.get(rank, []) + self._shown.pop(rank, [])
        free = self._free.get(rank)
        if free:
            target = free.pop(0)
            publish(rec.data, rec.metadata, transient={"display_id": target}, update=True)
            self._blank(free, publish)
        else:
            if label:
                self.write("stdout", label + "\n", rank)
            self._count += 1
            target = f"{self.run_id}-r{rank}-{self._count}"
            publish(rec.data, rec.metadata, transient={"display_id": target})
        self._shown.setdefault(rank, []).append(target)
        if rec.display_id is not None:
            self._alias[(rank, rec.display_id)] = target

    def live(self) -> bool:
        """Whether displays can be shown and updated (a kernel), so bars are drawn as bars."""
        return _publisher() is not None

    def bar(self, number: int, bar_id: str | None, data: dict) -> str:
        """Show the ``number``-th group of progress bars (a new output when ``bar_id`` is None), or update it;
        its id."""
        publish = _publisher()
        if bar_id is None:
            self._count += 1
            bar_id = f"{self.run_id}-bars{number}-{self._count}"
            publish(data, {}, transient={"display_id": bar_id})
        else:
            publish(data, {}, transient={"display_id": bar_id}, update=True)
        return bar_id

    def clear(self, rank: int, wait: bool) -> None:
        if wait:
            self._clear_pending.add(rank)
            return
        publish = _publisher()
        ids = self._shown.pop(rank, [])
        if publish is not None:
            self._blank(ids, publish)
        self._free[rank] = self._free.get(rank, []) + ids

    def close(self) -> None:
        """End of the run: a clear that waited for a next display that never came happens now."""
        for rank in list(self._clear_pending):
            self.clear(rank, wait=False)

    @staticmethod
    def _blank(ids, publish) -> None:
        for target in ids:
            publish({"text/plain": ""}, {}, transient={"display_id": target}, update=True)


def _publisher():
    """The display publisher of the place output goes to (this cell, or a background cell's), None outside
    a kernel: ``publish(data, metadata, transient=, update=)``."""
    place = output.current()
    if not place.live:
        return None
    return lambda data, metadata, transient=None, update=False: place.display(
        data, metadata, (transient or {}).get("display_id"), update=update)


class Relay:
    """Subscribes to the supervisor's Output / OutputClosed / Message events and writes the cell's output.

    Per rank and cell it shows at most ``max_lines`` lines and ``max_output_mb`` MiB (counted in
    characters), and of each line its first ``max_line_chars``; a note says where the rest is (the
    rank's log keeps every byte). A line that never ends costs bounded memory: past the cap it is
    shown cut, and the rest of it is dropped as it arrives. A rank's unfinished line on one stream is
    ended when its other stream's text arrives (the supervisor publishes them in the rank's order).
    With the prefix on and every rank shown, identical lines are merged (``Merger``)."""

    def __init__(self, sink, *, ranks_output: str, prefix: bool, max_lines: int, max_line_chars: int,
                 max_output_mb: float, ranks=(0,)):
        self.sink = sink
        self.max_lines = max_lines  # per rank shown in the cell; the log keeps everything
        self.max_line_chars = max_line_chars
        self.max_output_mb = max_output_mb
        self.max_output_bytes = int(max_output_mb * 2**20)  # counted in characters of the rank's own text
        self.ranks_output = ranks_output  # "all" | "0" | "none"
        self.prefix = prefix
        self._shown_lines: dict[int, int] = {}
        self._shown_chars: dict[int, int] = {}
        self._capped: set[int] = set()
        self._partial: dict[tuple[int, str], bytes] = {}
        self._cutting: set[tuple[int, str]] = set()  # a line shown cut: the rest of it is dropped
        self._closed: dict[int, int] = {}  # rank -> how many of its two streams closed
        # an unfinished line this long (bytes) holds more than max_line_chars characters (UTF-8: <= 4 bytes each)
        self._partial_limit = min(MAX_PARTIAL, 4 * max_line_chars + 4)
        merging = prefix and ranks_output == "all" and len(ranks) > 1  # among the ranks running the cell
        self.merger = Merger(ranks, self._write) if merging else None
        live = getattr(sink, "live", None)
        shown = [r for r in ranks if self._shown(r)]
        self.bars = Bars(sink, prefix, self._holding, self._before_bar, shown) if live is not None and live() else None

    def on_Output(self, event) -> None:
        rank, stream, data = event.rank, event.stream, event.data
        other = (rank, "stderr" if stream == "stdout" else "stdout")
        if other in self._partial:
            self._flush(*other, redraw_cleared=True)  # the rank wrote the other stream's unfinished line first
        key = (rank, stream)
        if key in self._cutting:
            end = data.find(b"\n")
            if end < 0:
                return
            self._cutting.discard(key)
            data = data[end + 1:]
        buf = self._partial.pop(key, b"") + data
        head, sep, tail = buf.rpartition(b"\n")
        if sep:
            self._emit(rank, stream, head)
        if b"\r" in tail:  # a line redrawn in place (print(..., end="\\r")): keep its latest state,
            tail = b"\r" + latest_redraw(tail)  # wherever the carriage returns sit
        if len(tail) > self._partial_limit:  # a line that never ends: shown cut, the rest dropped
            self._emit(rank, stream, tail)
            if self._partial_limit < MAX_PARTIAL:
                self._cutting.add(key)
            tail = b""  # (with a --max-line-chars beyond MAX_PARTIAL it is shown in pieces)
        if tail:
            self._partial[key] = tail

    def on_OutputClosed(self, event) -> None:
        self._flush(event.rank, event.stream)
        self._closed[event.rank] = self._closed.get(event.rank, 0) + 1
        if self._closed[event.rank] == 2:  # the rank has left: wait for it no more
            if self.merger is not None:
                self.merger.leave(event.rank)
            if self.bars is not None:
                self.bars.leave(event.rank)

    def on_Message(self, event) -> None:
        rec = event.record
        if type(rec) is messages.Progress:
            self._progress(event.rank, rec)
            return
        if not isinstance(rec, (messages.Display, messages.ClearOutput)) or not self._shown(event.rank):
            return
        for stream in ("stdout", "stderr"):  # what the rank printed before it displayed comes first
            self._flush(event.rank, stream)
        if self.merger is not None:
            self.merger.release(everything=True)
        if isinstance(rec, messages.ClearOutput):
            self.sink.clear(event.rank, rec.wait)
            return
        label = f"[rank{event.rank}]: display" if self.prefix else None  # every rank's, rank 0's too
        self.sink.display(event.rank, rec, label)

    def _progress(self, rank: int, rec) -> None:
        """A tqdm bar's state: below what the rank wrote before it (its unfinished lines end first), drawn
        live. A bar without a total (nothing to fill), or any bar outside a kernel (no live outputs), is a line:
        its last state, once it closes, on the stream tqdm would have drawn it on."""
        if not self._shown(rank) or rank in self._capped:
            return
        for stream in ("stdout", "stderr"):
            self._flush(rank, stream, redraw_cleared=True)
        if self.bars is not None and (rec.fraction is not None or (rank, rec.bar) in self.bars.open):
            self.bars.update(rank, rec)
        elif rec.closed and rec.leave:
            self._lines(rank, rec.stream, [rec.line])

    def release_due(self) -> float | None:
        """Lines held for merging whose wait is over are shown, bars redrawn; when the next is due (the
        engine wakes then)."""
        due = [t for t in (self.merger and self.merger.release(), self.bars and self.bars.due()) if t]
        return min(due) if due else None

    def close_all(self) -> None:
        for rank, stream in list(self._partial):
            self._flush(rank, stream)
        if self.bars is not None:
            self.bars.close()
        if self.merger is not None:
            self.merger.release(everything=True)
        self.sink.close()

    def _before_bar(self) -> None:
        """A bar's output goes below what its rank wrote before it."""
        if self.merger is not None:
            self.merger.release(everything=True)

    def _holding(self, rank: int) -> bool:
        """Whether lines of ``rank`` wait to be merged (its new bar waits for them: at most MERGE_S)."""
        return self.merger is not None and bool(self.merger.held.get(rank))

    def _flush(self, rank: int, stream: str, redraw_cleared: bool = False) -> None:
        tail = self._partial.pop((rank, stream), b"")
        if redraw_cleared and tail.startswith(b"\r") and not tail.strip():
            return  # a redrawn line left blank (tqdm.write clears its bar to print): nothing to show
        if tail:
            self._emit(rank, stream, tail)

    def _shown(self, rank: int) -> bool:
        """Whether the cell shows ``rank``'s output (--ranks-output), one running the cell or not."""
        return self.ranks_output == "all" or (self.ranks_output == "0" and rank == 0)

    def _emit(self, rank: int, stream: str, block: bytes) -> None:
        if not self._shown(rank) or rank in self._capped:
            return
        decoded = block.decode("utf-8", "replace")
        lines = decoded.split("\n")
        if "\r" not in decoded:
            self._lines(rank, stream, lines)
            return
        self._lines(rank, stream, [last_segment(raw) for raw in lines])

    def _lines(self, rank: int, stream: str, lines: list[str]) -> None:
        """Whole lines of one rank, cut and capped, to the merger or the cell."""
        if rank in self._capped:
            return
        cap = self.max_line_chars
        if max(map(len, lines)) > cap:
            note = (f" ... [line cut at {cap} characters (--max-line-chars): all of it is in rank{rank}.log "
                    "in the run directory]")
            lines = [ln if len(ln) <= cap else ln[:cap] + note for ln in lines]
        room = self.max_lines - self._shown_lines.get(rank, 0)
        chars = sum(map(len, lines)) + len(lines)  # the rank's own text, a newline after each line
        if len(lines) > room or chars > self.max_output_bytes - self._shown_chars.get(rank, 0):
            lines = self._fit(rank, lines, room)
            chars = sum(map(len, lines)) + len(lines)
        self._shown_lines[rank] = self._shown_lines.get(rank, 0) + len(lines)
        self._shown_chars[rank] = self._shown_chars.get(rank, 0) + chars
        if self.merger is not None and rank in self.merger.held:
            self.merger.add(rank, stream, lines)
        else:  # (a rank not running the cell, printing from a thread of its own, is not waited for)
            self._write((rank,), stream, lines)

    def _write(self, ranks: tuple, stream: str, lines: list[str]) -> None:
        if not self.prefix:
            self.sink.write(stream, "\n".join(lines) + "\n", ranks[0])
            return
        tag = f"[rank{rank_span(ranks)}]:"
        text = tag + f"\n{tag}".join(lines) + "\n"
        if len(ranks) == 1 and tag + tag in text:  # torch's own "[rankN]:" prefix (its C++ warnings): not doubled
            text = text.replace(tag + tag, tag)
        self.sink.write(stream, text, ranks[0] if len(ranks) == 1 else ranks)

    def _fit(self, rank: int, lines: list[str], room: int) -> list[str]:
        """The lines that fit under both caps, then the note that says the rest is in the log."""
        room_chars = self.max_output_bytes - self._shown_chars.get(rank, 0)
        n = 0
        while n < len(lines) and n < room and (room_chars := room_chars - len(lines[n]) - 1) >= 0:
            n += 1
        self._capped.add(rank)
        limit = f"--max-lines {self.max_lines}" if n >= room else f"--max-output-mb {self.max_output_mb:g}"
        note = f"... more output than {limit}: the rest is only in the log (rank{rank}.log in the run directory)"
        return [*lines[:n], note]


@dataclass
class BarRow:
    """A rank's bar in its group: the latest state its rank sent (a ``messages.Progress``), and whether it
    closed (``final``: kept as it is) or tqdm cleared it (``leave=False``: gone)."""
    state: object
    final: bool = False
    cleared: bool = False


@dataclass
class BarGroup:
    """The n-th bar of every rank (epoch n's, say): one output, a row per rank in rank order, so bars never
    shuffle by which rank drew first. ``display_id``: its output once shown; ``drawn_at``: when it was last
    redrawn; ``changed``: a row moved since."""
    number: int
    opened_at: float
    rows: dict[int, BarRow] = field(default_factory=dict)
    display_id: str | None = None
    drawn_at: float = 0.0
    changed: bool = False


class Bars:
    """Each rank's tqdm bars as progress bars in the cell, in rank order: a rank's n-th bar is a row of the
    n-th group, one output redrawn by display id at most every BAR_EVERY_S (the engine wakes for a redraw
    that waited). A group is first shown once every rank shown has its row there, or BAR_GATHER_S after the
    first (a rank drawing no bar is not waited for longer), and not while lines a rank of it wrote before its
    bar wait to be merged (``holding``, at most MERGE_S), so it goes below them; a bar's final state shows it
    at once if it was not shown yet. A row's final state is redrawn at once only when it completes the group
    (every rank's row there and final or cleared), else with the group's next redraw: 64 ranks ending a bar
    publish a few outputs, not 64 of every row. An output is never published empty (a bar cleared before it
    was shown leaves nothing in the notebook).

    Only groups with a redraw waiting (``dirty``) are looked at each turn of the engine's loop, and a group
    is forgotten once complete and shown and no rank can add a row to it (each rank still writing has started
    a later bar); of those a rank drawing no bar might still add to, the latest ``BAR_KEEP`` are kept (a
    ``tqdm(leave=False)`` a step makes thousands of groups in a cell): a rank that many bars behind shows its
    later bars in outputs of their own.

    ``ranks``: the ranks whose bars are shown; ``before()``: what a group shown at once first releases
    (the merger's held lines)."""

    def __init__(self, sink, prefix: bool, holding, before, ranks=(0,)):
        self.sink, self.prefix, self.holding, self.before = sink, prefix, holding, before
        self.expected = set(ranks)  # ranks still writing whose bars a group waits for
        self.open: dict[tuple[int, int], BarGroup] = {}  # (rank, its bar's number) -> the group of a bar drawing
        self.started: dict[int, int] = {}  # rank -> how many bars it started
        self.groups: dict[int, BarGroup] = {}  # by number: the groups a rank may still draw in or add to
        self.dirty: set[int] = set()  # groups changed since last shown
        self.settled: set[int] = set()  # groups complete and shown (kept while a rank may add a row)

    def update(self, rank: int, rec) -> None:
        """A bar's record (``messages.Progress``): a redraw, its last state, or cleared."""
        if not rec.closed:
            self.draw(rank, rec)
        elif rec.leave:
            self.done(rank, rec)
        else:
            self.cleared(rank, rec)

    def draw(self, rank: int, rec) -> None:
        """A bar's latest redraw."""
        key, now = (rank, rec.bar), time.monotonic()
        group = self.open.get(key) or self._start(rank, rec, now)
        self.open[key] = group
        group.rows[rank].state = rec
        self._changed(group)
        self._redraw(group, now)

    def done(self, rank: int, rec) -> None:
        """The bar closed: its last state stays, as a static bar."""
        now = time.monotonic()
        group = self.open.pop((rank, rec.bar), None) or self._start(rank, rec, now)
        row = group.rows[rank]
        row.state, row.final = rec, True
        self._changed(group)
        if group.display_id is None or self._complete(group):  # its place in the cell, or its last state
            self._show(group, now)

    def cleared(self, rank: int, rec) -> None:
        """tqdm(leave=False) cleared the bar: its row goes."""
        group = self.open.pop((rank, rec.bar), None)
        if group is None:  # (closed before this cell saw it draw)
            return
        group.rows[rank].cleared = True
        self._changed(group)
        if group.display_id is not None and self._complete(group):
            self._show(group, time.monotonic())

    def leave(self, rank: int) -> None:
        """The rank has left: groups wait for its bar no more."""
        self.expected.discard(rank)

    def due(self) -> float | None:
        """Redraws that waited are made; when the next is due."""
        if not self.dirty:
            return None
        now = time.monotonic()
        due = [t for number in list(self.dirty) if (t := self._redraw(self.groups[number], now))]
        return min(due) if due else None

    def close(self) -> None:
        """The cell ended, however it ended: each bar still drawing is kept at the last state its rank sent,
        every group redrawn once."""
        for (rank, _), group in self.open.items():
            group.rows[rank].final = True
            self._changed(group)
        self.open.clear()
        now = time.monotonic()
        for number in sorted(self.dirty):
            self._show(self.groups[number], now)

    def _start(self, rank: int, rec, now: float) -> BarGroup:
        number = self.started.get(rank, 0)
        self.started[rank] = number + 1
        group = self.groups.get(number)
        if group is None:  # (a group forgotten that a rank far behind adds to: a new output)
            group = self.groups[number] = BarGroup(number, opened_at=now)
        self.settled.discard(number)
        group.rows[rank] = BarRow(rec)
        return group

    def _changed(self, group: BarGroup) -> None:
        group.changed = True
        self.dirty.add(group.number)

    def _complete(self, group: BarGroup) -> bool:
        """Every rank's row is there and no bar of it is drawing any more."""
        return self.expected <= group.rows.keys() and all(row.final or row.cleared for row in group.rows.values())

    def _redraw(self, group: BarGroup, now: float) -> float | None:
        """Shown or redrawn now if it may be; else when it may."""
        if group.display_id is None:
            if not self.expected <= group.rows.keys() and now < group.opened_at + BAR_GATHER_S:
                return group.opened_at + BAR_GATHER_S
            if any(self.holding(r) for r in group.rows):
                return now + 0.05  # (the merger's own wait ends about then)
        elif now - group.drawn_at < BAR_EVERY_S:
            return group.drawn_at + BAR_EVERY_S
        self._show(group, now)
        return None

    def _show(self, group: BarGroup, now: float) -> None:
        data = self._data(group)
        if group.display_id is None:
            if data is not None:  # (nothing to show yet: every row of it cleared)
                self.before()  # below what its ranks wrote before it
                group.display_id = self.sink.bar(group.number, None, data)
        else:
            group.display_id = self.sink.bar(group.number, group.display_id, data or {"text/plain": ""})
        group.drawn_at, group.changed = now, False
        self.dirty.discard(group.number)
        if all(row.final or row.cleared for row in group.rows.values()):
            self.settled.add(group.number)
            self._forget()

    def _forget(self) -> None:
        """Groups complete and shown that no rank can add to go, and of the rest all but the latest BAR_KEEP."""
        floor = min((self.started.get(r, 0) for r in self.expected), default=None)
        gone = [n for n in self.settled if floor is None or n < floor]
        if len(self.settled) - len(gone) > BAR_KEEP:
            gone += sorted(n for n in self.settled if not (floor is None or n < floor))[:-BAR_KEEP]
        for n in gone:
            self.settled.discard(n)
            self.groups.pop(n, None)

    def _data(self, group: BarGroup) -> dict | None:
        """The group's output (None: every row cleared)."""
        rows = [(rank, row) for rank, row in sorted(group.rows.items()) if not row.cleared]
        if not rows:
            return None
        label = (lambda rank: f"[rank{rank}]:") if self.prefix else (lambda rank: "")
        plain = "\n".join(label(rank) + row.state.line for rank, row in rows)
        # the stream's own font and left edge (JupyterLab pads a text output 1ch, an HTML one not at all), so a
        # rank's bar and its lines start in the same column
        html_rows = "".join(_bar_html(label(rank), row) for rank, row in rows)
        return {"text/plain": plain,
                "text/html": "<div class='nbddp-bars' style='font-family:var(--jp-code-font-family,monospace);"
                             "font-size:var(--jp-code-font-size,13px);line-height:var(--jp-code-line-height,1.4);"
                             f"margin-left:1ch'>{html_rows}</div>"}


def _bar_html(label: str, row: BarRow) -> str:
    """One rank's bar: its label and description, the bar, the percentage and tqdm's counts and rate (a bar
    without a total: tqdm's line, no bar)."""
    rec, esc = row.state, html.escape
    frac = rec.fraction
    if frac is None:
        return ("<div class='nbddp-bar' style='white-space:pre;overflow:hidden;text-overflow:ellipsis'>"
                f"{esc(label)}{esc(rec.line)}</div>")
    pct = round(frac * 100)
    colour = RUNNING if not row.final else DONE if pct == 100 else WARN
    desc = rec.state.get("prefix") or ""
    bar = (f"<span style='display:inline-block;width:160px;height:10px;background:{TRACK};vertical-align:middle;"
           f"border-radius:2px'><span style='display:inline-block;width:{pct}%;height:100%;background:{colour};"
           "border-radius:2px'></span></span>")
    return ("<div class='nbddp-bar' style='white-space:pre;overflow:hidden;text-overflow:ellipsis'>"
            f"{esc(label)}{esc(desc + ': ' if desc else '')}{bar} {pct}%{esc(_counts(rec.state))}</div>")


def _counts(state: dict) -> str:
    """tqdm's counts, times and rate for a bar's state (`` 45/100 [00:01<00:01, 45.00it/s]``), formatted by
    tqdm itself where the kernel has it."""
    try:
        from tqdm.std import tqdm
    except ImportError:
        return f" {state.get('n')}/{state.get('total')}"
    try:
        return tqdm.format_meter(**{**state, "bar_format": "{r_bar}"})[1:]
    except Exception:  # noqa: BLE001 - a state this tqdm cannot format: the counts alone
        return f" {state.get('n')}/{state.get('total')}"


class Merger:
    """Each rank's lines wait up to ``window`` s for the same line from every other rank still writing.
    When every such rank has a line waiting, their first lines are compared: ranks whose lines are equal
    (same text, same stream) get it written once, labelled with them all; a line no other rank holds goes
    out on its own. A rank that has left (its streams closed) is waited for no more. Each rank's lines
    keep their order; ``write(ranks, stream, lines)`` shows them."""

    def __init__(self, ranks, write, window: float = MERGE_S):
        self.writing = set(ranks)
        self.held: dict[int, list] = {r: [] for r in ranks}  # rank -> [(arrival, stream, line)], oldest first
        self.write, self.window = write, window

    def add(self, rank: int, stream: str, lines: list[str]) -> None:
        now = time.monotonic()
        self.held[rank].extend([(now, stream, ln) for ln in lines])
        self.release(now)

    def leave(self, rank: int) -> None:
        self.writing.discard(rank)
        self.release()

    def release(self, now: float | None = None, everything: bool = False) -> float | None:
        """Write what can be decided (all of it if ``everything``); return when the next wait ends."""
        now = time.monotonic() if now is None else now
        while True:
            pending = {r: q for r, q in self.held.items() if q}
            if not pending:
                return None
            if self.writing <= pending.keys():
                self._compare(pending)
                continue
            if not self._expired(pending, now - self.window, everything):
                return min(q[0][0] for q in pending.values()) + self.window

    def _compare(self, pending: dict) -> None:
        """Every rank still writing has lines waiting: compare them in step, from the first."""
        qs = list(pending.items())
        groups: dict[tuple, list[int]] = {}
        for r, q in qs:
            groups.setdefault(q[0][1:], []).append(r)
        if len(groups) == len(qs):  # no two alike: as many lines of each, in step, as stay unlike
            end, n = min(len(q) for _, q in qs), 1
            while n < end and len({q[n][1:] for _, q in qs}) == len(qs):
                n += 1
            for r, q in qs:
                self._out((r,), q, n)
            return
        for ranks in groups.values():
            group = [pending[r] for r in ranks]
            n, first = 1, group[0]
            if len(group) > 1:  # as many lines as every rank of the group has alike
                end = min(map(len, group))
                while n < end and all(q[n][1] == first[n][1] and q[n][2] == first[n][2] for q in group[1:]):
                    n += 1
            self._out(tuple(ranks), first, n)
            for q in group[1:]:
                del q[:n]

    def _expired(self, pending: dict, limit: float, everything: bool) -> bool:
        wrote = False
        for r, q in pending.items():
            n = len(q)
            if not everything:
                n = 0
                while n < len(q) and q[n][0] <= limit:
                    n += 1
            if n:
                self._out((r,), q, n)
                wrote = True
        return wrote

    def _out(self, ranks: tuple, q: list, n: int) -> None:
        """The first ``n`` lines of ``q`` (removed from it), one write per run of one stream."""
        start = 0
        for i in range(1, n + 1):
            if i == n or q[i][1] != q[start][1]:
                self.write(ranks, q[start][1], [item[2] for item in q[start:i]])
                start = i
        del q[:n]


def latest_redraw(tail: bytes) -> bytes:
    """The last non-empty state of a line redrawn with carriage returns, with the \\r that ended it."""
    end = len(tail.rstrip(b"\r"))
    start = tail.rfind(b"\r", 0, end) + 1
    return tail[start:]


def last_segment(line: str) -> str:
    """A line redrawn with carriage returns (progress bars) keeps only what was drawn last."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""
