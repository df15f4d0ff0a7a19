"""Every byte each rank writes, kept in its ``rankN.log`` (0600) in the run directory: the cell may trim
output, the log never does."""
from __future__ import annotations

import os


class RankLogs:
    """Every byte each rank writes, kept in ``rankN.log`` (0600) in the run directory."""

    def __init__(self, log_paths: dict[int, str]):
        self._fds = {r: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for r, p in log_paths.items()}

    def on_Output(self, event) -> None:
        fd = self._fds.get(event.rank)
        if fd is not None:
            os.write(fd, event.data)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
