"""Where each rank is: its Python stacks, asked for and kept (one home for stack dumps in the kernel).

A rank dumps every thread's stack to its stderr on SIGUSR1 (faulthandler, installed as it starts).
``StackRequest`` is one such ask, made by the supervisor (--timeout, an interrupt, the collective probe):
the ranks signalled, their stderr collected until it has been quiet ``QUIET_S`` (or ``MAX_S`` passed), then
what was to follow. ``StackCapture``, a listener in front of the cell's relay, keeps those bytes for the
report and out of the cell's output (a tqdm bar drawn meanwhile is a record on its channel, never held
back). How a
dump reads (its headers, the user's frames) is ipy/tracebacks.py's, on either side.
"""
from __future__ import annotations

import signal
import time

QUIET_S = 0.3  # stacks are complete once the asked ranks' stderr is quiet this long
MAX_S = 2.0  # ... or this long after the ask, whichever comes first


class StackRequest:
    """One ask for ``procs``' stacks on ``sup`` (its schedule times it); ``then()`` once they are in."""

    def __init__(self, sup, procs, then=None):
        self.sup, self.then = sup, then
        self.ranks = [p.rank for p in procs]
        now = time.monotonic()
        self.quiet_at, self.end = now + QUIET_S, now + MAX_S
        for p in procs:
            p.signal(signal.SIGUSR1)
        self._timer = sup.at(self.quiet_at, self._check)

    def arriving(self) -> None:
        """A dump still arriving (the ranks' stderr): the collection goes on."""
        self.quiet_at = time.monotonic() + QUIET_S

    def _check(self) -> None:
        due = min(self.quiet_at, self.end)
        if time.monotonic() < due:
            self._timer = self.sup.at(due, self._check)
            return
        self.sup.collected(self)
        if self.then is not None:
            self.then()


class StackCapture:
    """Subscribes to the supervisor's events: from a StacksRequested on, each such rank's stderr is
    faulthandler's dump of its stacks. It is kept here for the report (trimmed to the user's frames
    there) and not passed on to ``shown`` (the relay), so the cell shows the stacks once; the log writer
    subscribes on its own and keeps every byte. Every other event goes to ``shown`` unchanged."""

    def __init__(self, shown=None):
        self.shown = shown
        self._bytes: dict[int, bytearray] | None = None
        self._done = False

    def on_StacksRequested(self, event) -> None:
        self._bytes = {r: bytearray() for r in event.ranks}
        self._done = False

    def on_Output(self, event) -> None:
        if self._bytes is not None and not self._done and event.stream == "stderr" and event.rank in self._bytes:
            self._bytes[event.rank] += event.data  # (a bar drawn meanwhile is a record on the channel: not held)
        elif self.shown is not None:
            self.shown.on_Output(event)

    def __getattr__(self, name):  # the relay's other events (OutputClosed, Message, ...), as they come
        shown = self.__dict__.get("shown")
        if name.startswith("on_") and shown is not None:
            return getattr(shown, name)
        raise AttributeError(name)

    def release(self) -> None:
        """The stacks asked for are in: the ranks' stderr goes to the cell again (the stacks are kept)."""
        self._done = True

    def stacks(self) -> dict[int, str]:
        return {r: b.decode("utf-8", "replace") for r, b in (self._bytes or {}).items()}
