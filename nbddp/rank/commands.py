"""In a rank: its command pipe, read by the server between commands and by ``input()`` during one.

A forked rank has one (a pool's commands, a one-shot cell's ``Stop``, the kernel's ``InputReply``);
what arrives while the cell waits for its input is kept for the server, in order."""
from __future__ import annotations

import os
import sys

from ..wire import framing


class CommandPipe:
    def __init__(self, fd: int):
        self.fd = fd
        self.reader = framing.Reader()
        self.kept: list = []  # commands read while waiting for something else

    def next(self) -> list:
        """The next commands, in order (blocks until one arrives); the kernel closing the pipe ends the rank."""
        if self.kept:
            kept, self.kept = self.kept, []
            return kept
        return self._read()

    def until(self, wanted):
        """The first command for which ``wanted(cmd)`` holds; the others are kept for ``next``, in order."""
        queue, self.kept = self.kept, []
        while True:
            for i, cmd in enumerate(queue):
                if wanted(cmd):
                    self.kept += queue[i + 1:]
                    return cmd
                self.kept.append(cmd)
            queue = self._read()

    def _read(self) -> list:
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except InterruptedError:
                continue
            if not data:  # the kernel closed the pipe: it is gone or stopped the pool
                sys.exit(0)
            records = [record for record, _ in self.reader.feed(data)]
            if records:
                return records
