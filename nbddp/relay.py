"""Rank output -> whole, rank-prefixed lines, in order per rank, never fragmented.

The supervisor feeds raw bytes as they arrive on each rank's stdout/stderr pipe; the relay cuts them
at newlines, keeps partial lines until they are complete, and hands complete blocks of lines to a
sink (the cell's stream, or the dashboard). Every byte also goes to the rank's log file (0600) in the
run directory, so nothing is lost when a display trims output.
"""
from __future__ import annotations

import os
import sys

MAX_PARTIAL = 1 << 20  # bytes of an unfinished line kept per rank and stream


class TextSink:
    """Writes prefixed lines to the parent's own stdout/stderr (the cell, in a kernel)."""

    def write(self, stream: str, text: str) -> None:
        (sys.stderr if stream == "stderr" else sys.stdout).write(text)

    def flush(self) -> None:
        for s in (sys.stdout, sys.stderr):
            s.flush()


class Relay:
    def __init__(self, sink, *, ranks_output: str = "all", prefix: bool = True, log_paths=None,
                 max_lines: int = 200_000):
        self.sink = sink
        self.max_lines = max_lines  # per rank shown in the cell; the log keeps everything
        self._shown_lines: dict[int, int] = {}
        self._capped: set[int] = set()
        self.ranks_output = ranks_output  # "all" | "0" | "none"
        self.prefix = prefix
        self.last_line: dict[int, str] = {}
        self._partial: dict[tuple[int, str], bytes] = {}
        self._capture: dict[int, list[str]] | None = None
        self._logs = {r: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for r, p in (log_paths or {}).items()}

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        if rank in self._logs:
            os.write(self._logs[rank], data)
        key = (rank, stream)
        buf = self._partial.pop(key, b"") + data
        head, sep, tail = buf.rpartition(b"\n")
        if sep:
            self._emit(rank, stream, head)
        if len(tail) > MAX_PARTIAL:  # a "line" that never ends: show it in pieces, keep memory bounded
            self._emit(rank, stream, tail)
            tail = b""
        if b"\r" in tail:  # a progress bar redrawing in place: only its latest state is worth keeping
            latest = next((seg for seg in reversed(tail.split(b"\r")) if seg), b"")
            tail = b"\r" + latest
            self.last_line[rank] = latest.decode("utf-8", "replace")  # the dashboard shows it live
        if tail:
            self._partial[key] = tail

    def close(self, rank: int, stream: str) -> None:
        tail = self._partial.pop((rank, stream), b"")
        if tail:
            self._emit(rank, stream, tail)

    def close_all(self) -> None:
        for rank, stream in list(self._partial):
            self.close(rank, stream)
        for fd in self._logs.values():
            os.close(fd)
        self._logs.clear()

    def start_capture(self) -> None:
        """Collect every rank's following stderr lines (for stacks dumped at a timeout)."""
        self._capture = {}

    def captured(self) -> dict[int, str]:
        got = {r: "\n".join(lines) for r, lines in (self._capture or {}).items()}
        self._capture = None
        return got

    def _shown(self, rank: int) -> bool:
        return self.ranks_output == "all" or (self.ranks_output == "0" and rank == 0)

    def _emit(self, rank: int, stream: str, block: bytes) -> None:
        lines = [_last_segment(ln) for ln in block.decode("utf-8", "replace").split("\n")]
        self.last_line[rank] = lines[-1]
        if self._capture is not None and stream == "stderr":
            self._capture.setdefault(rank, []).extend(lines)
        if not self._shown(rank):
            return
        room = self.max_lines - self._shown_lines.get(rank, 0)
        if len(lines) > room:
            if rank in self._capped:
                return
            self._capped.add(rank)
            lines = lines[: max(room, 0)] + [
                f"... more output than --max-lines {self.max_lines}: the rest is only in the log "
                f"(rank{rank}.log in the run directory)"]
        self._shown_lines[rank] = self._shown_lines.get(rank, 0) + len(lines)
        if self.prefix:
            tag = f"[rank{rank}]:"
            text = tag + f"\n{tag}".join(lines) + "\n"
        else:
            text = "\n".join(lines) + "\n"
        self.sink.write(stream, text)


def _last_segment(line: str) -> str:
    """A line redrawn with carriage returns (progress bars) keeps only what was drawn last."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""
