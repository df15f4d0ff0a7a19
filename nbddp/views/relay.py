"""Rank output -> the cell: whole, rank-prefixed lines and rich displays, in order per rank, never fragmented.

The relay subscribes to the supervisor's events: raw bytes as they arrive on each rank's stdout/stderr
pipe, which it cuts at newlines (keeping partial lines until they are complete, a carriage-return redraw
as its latest state), and the displays a rank sends on its channel, before which that rank's pending
text is flushed. It hands both to a sink (the cell). The rank's log file (kernel/logs.py) keeps every
byte, so nothing is lost when the cell trims output.
"""
from __future__ import annotations

import sys

from ..wire import messages
from ..wire.budget import Budget
from ..ipy.session import running_shell


MAX_PARTIAL = 1 << 20  # bytes of an unfinished line kept per rank and stream


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
            _std(last).flush()
        self._last[rank] = stream
        _std(stream).write(text)

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


def _std(stream: str):
    return sys.stderr if stream == "stderr" else sys.stdout


def _publisher():
    if running_shell() is None:
        return None
    from IPython.display import publish_display_data

    return publish_display_data


class Relay:
    """Subscribes to the supervisor's Output / OutputClosed / Message events and writes the cell's output.

    Per rank and cell it shows at most ``max_lines`` lines and ``max_output_mb`` MiB (counted in
    characters), and of each line its first ``max_line_chars``; a note says where the rest is (the
    rank's log keeps every byte). A line that never ends costs bounded memory: past the cap it is
    shown cut, and the rest of it is dropped as it arrives. A rank's unfinished line on one stream is
    ended when its other stream's text arrives (the supervisor publishes them in the rank's order)."""

    def __init__(self, sink, *, ranks_output: str, prefix: bool, max_lines: int, max_line_chars: int,
                 max_output_mb: float):
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
        # an unfinished line this long (bytes) holds more than max_line_chars characters (UTF-8: <= 4 bytes each)
        self._partial_limit = min(MAX_PARTIAL, 4 * max_line_chars + 4)

    def on_Output(self, event) -> None:
        rank, stream, data = event.rank, event.stream, event.data
        other = (rank, "stderr" if stream == "stdout" else "stdout")
        if other in self._partial:  # the rank wrote the other stream's unfinished line first
            self._flush(*other, redraw_cleared=True)
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
        if b"\r" in tail:  # a line redrawn in place (tqdm, print(..., end="\\r")): keep its latest state,
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

    def on_Message(self, event) -> None:
        rec = event.record
        if not isinstance(rec, (messages.Display, messages.ClearOutput)) or not self._shown(event.rank):
            return
        for stream in ("stdout", "stderr"):  # what the rank printed before it displayed comes first
            self._flush(event.rank, stream)
        if isinstance(rec, messages.ClearOutput):
            self.sink.clear(event.rank, rec.wait)
            return
        label = f"[rank{event.rank}]: display" if (self.prefix and event.rank != 0) else None
        self.sink.display(event.rank, rec, label)

    def close_all(self) -> None:
        for rank, stream in list(self._partial):
            self._flush(rank, stream)
        self.sink.close()

    def _flush(self, rank: int, stream: str, redraw_cleared: bool = False) -> None:
        tail = self._partial.pop((rank, stream), b"")
        if redraw_cleared and tail.startswith(b"\r") and not tail.strip():
            return  # a redrawn line left blank (tqdm.write clears its bar to print): nothing to show
        if tail:
            self._emit(rank, stream, tail)

    def _shown(self, rank: int) -> bool:
        return self.ranks_output == "all" or (self.ranks_output == "0" and rank == 0)

    def _emit(self, rank: int, stream: str, block: bytes) -> None:
        if not self._shown(rank) or rank in self._capped:
            return
        decoded = block.decode("utf-8", "replace")
        lines = decoded.split("\n")
        if "\r" in decoded:
            lines = [last_segment(ln) for ln in lines]
        cap = self.max_line_chars
        if len(block) > cap and max(map(len, lines)) > cap:  # (bytes >= characters)
            note = (f" ... [line cut at {cap} characters (--max-line-chars): all of it is in rank{rank}.log "
                    "in the run directory]")
            lines = [ln if len(ln) <= cap else ln[:cap] + note for ln in lines]
        tag = f"[rank{rank}]:" if self.prefix else ""
        room = self.max_lines - self._shown_lines.get(rank, 0)
        text = tag + f"\n{tag}".join(lines) + "\n" if len(lines) <= room else None
        chars = len(text) - len(tag) * len(lines) if text is not None else 0  # the rank's own text
        if text is None or chars > self.max_output_bytes - self._shown_chars.get(rank, 0):
            lines = self._fit(rank, lines, room)
            text = tag + f"\n{tag}".join(lines) + "\n"
            chars = len(text) - len(tag) * len(lines)
        if tag and tag in decoded:  # torch's own "[rankN]:" prefix (its C++ warnings, logs): not doubled
            text = text.replace(tag + tag, tag)
        self._shown_lines[rank] = self._shown_lines.get(rank, 0) + len(lines)
        self._shown_chars[rank] = self._shown_chars.get(rank, 0) + chars
        self.sink.write(stream, text, rank)

    def _fit(self, rank: int, lines: list[str], room: int) -> list[str]:
        """The lines that fit under both caps, then the note that says the rest is in the log."""
        room_chars = self.max_output_bytes - self._shown_chars.get(rank, 0)
        n = 0
        while n < len(lines) and n < room and (room_chars := room_chars - len(lines[n]) - 1) >= 0:
            n += 1
        self._capped.add(rank)
        limit = f"--max-lines {self.max_lines}" if n >= room else f"--max-output-mb {self.max_output_mb:g}"
        return lines[:n] + [f"... more output than {limit}: the rest is only in the log "
                            f"(rank{rank}.log in the run directory)"]


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
