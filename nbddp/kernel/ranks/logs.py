"""Every byte each rank writes, kept in its ``rankN.log`` (0600) in the run directory: the cell may trim
output, the log never does. A rank's tqdm bars, which travel as records (``messages.Progress``), are kept
as the text tqdm would have drawn: each state a carriage-return redraw of its line, the line ended when the
bar closes or the rank writes anything else."""
from __future__ import annotations

import contextlib
import os

from ...wire.messages import Progress


class RankLogs:
    """Every byte each rank writes, kept in ``rankN.log`` (0600) in the run directory, its bars as text."""

    def __init__(self, run_dir, ranks):
        self.run_dir = run_dir  # (rendezvous.RunDir: ``log(rank)``, the path of a rank's log)
        self._fds = self._open(ranks)
        self._bar: dict[int, int] = {}  # rank -> the bar whose line is drawn last and not ended yet
        self._replaying = False  # (kept_already)

    def _open(self, ranks) -> dict[int, int]:
        return {r: os.open(str(self.run_dir.log(r)), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for r in ranks}

    @contextlib.contextmanager
    def kept_already(self):
        """Text the ranks wrote while a keeper held their pool (it wrote their logs then), replayed: not again."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def on_Output(self, event) -> None:
        fd = self._fds.get(event.rank)
        if fd is not None and not self._replaying:
            if self._bar.pop(event.rank, None) is not None:  # the bar's line ends before the rank's text
                os.write(fd, b"\n")
            os.write(fd, event.data)

    def on_Message(self, event) -> None:
        rec = event.record
        if type(rec) is not Progress or (fd := self._fds.get(event.rank)) is None:
            return
        drawn = self._bar.pop(event.rank, None)
        text = ("\n" if drawn is not None and drawn != rec.bar else "") + "\r" + rec.line
        if rec.closed:
            text += "\n"
        else:
            self._bar[event.rank] = rec.bar
        os.write(fd, text.encode("utf-8", "replace"))

    def on_Moved(self, event) -> None:
        """The pool's ranks moved (supervisor.Moved): the logs of the ranks it has now."""
        self.renumber([*event.moves.values(), *event.added])

    def renumber(self, ranks) -> None:
        """Ranks moved (a pool shrunk or grew): each rank's bytes go on in its new number's log (those of
        ``ranks``, the ranks there are now)."""
        for fd in self._fds.values():
            os.close(fd)
        self._bar.clear()
        self._fds = self._open(ranks)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
