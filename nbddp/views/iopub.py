"""A pool cell's line onto the kernel's iopub socket, made and sent on ipykernel's IO thread, with its next
wake rather than one of its own: its place as the cell begins (a display id), and a quick cell's final line
there (an update).

IPython's display machinery costs ~0.8 ms a call; ipykernel's IO thread makes and sends every iopub
message in the order they were queued, so a message queued there goes out in order with the kernel's own
(the place before the cell's first text or display, whose write wakes the thread; the final line before
the cell's ``Out[]`` and the kernel's idle status). Waking that thread for the line costs the cell time
(the wake, then the thread takes the GIL to make and send the message while the cell ends). So the line
is queued without a wake: the kernel's next message (the cell's ``Out[]``, its idle status) wakes the
thread and it goes first. A loop of pool cells inside one notebook cell has no next message for a while: a
tick on the IO thread every ``LATE_S`` sends what is still queued, so a line is at most that late, as
ipykernel's own stdout (sent every 0.2 s). The tick stops after ``IDLE_S`` without a line and starts again
(one wake) with the next.

Queueing without a wake needs ipykernel's private IOPubThread internals (``_events``, ``_handle_event``,
``io_loop.call_later``); ``queue_without_wake`` is their one user (``unsent`` reads a flag of ipykernel's
streams, flushing a stream that lacks it), checked once per IO thread, and where they are missing (another
ipykernel, not ipykernel) or ``QUEUED`` is off the line is sent the ordinary way (``session.send``, a wake
of its own): the same outputs, in the same order (tests/test_pool_view.py, on ipykernel 7.x and, in CI, on
the hosted stacks' 6.17). Kept because it is worth it where the figures are taken
(benchmarks/bench_iopub.py, results.md section 12, interleaved in one kernel): a trivial pool cell takes
~0.3-0.5 ms less (1.75 ms against 2.23 ms alone, the floor 0.60 ms; 1.12 against 1.42 in a loop), a fifth of
it; a client waiting for a single notebook cell's idle status sees the same either way (the IO thread's work
moves after the cell), so the gain is the cell's own time: pool cells back to back, and the pool figures the
benchmarks hold to their targets (sections 1c and 10).
"""
from __future__ import annotations

import html
import sys
import threading
import time

from . import output
from .theme import MUTED

LATE_S = 0.1  # at most this late: a line no message of the kernel's sent
IDLE_S = 30.0  # the tick stops after this long without a line
QUEUED = True  # False: every line sent the ordinary way (benchmarks/bench_iopub.py measures both)


def publish_line(line: str, flush: bool, display_id: str | None = None, update: bool = False, chart=None) -> None:
    """A one-line static summary (``text/plain``, grey ``text/html``) as display data, with ``chart`` (what
    the ranks logged, metrics_chart.py) below it. ``flush``: the cell wrote text to the kernel's streams, which goes
    first. ``display_id``: its output's id, for later updates (``update``: this one redraws that output in
    place, wherever it is)."""
    data = line_bundle(line, chart)
    transient = {"display_id": display_id} if display_id else {}
    place = output.current()
    if place is not output.HERE:  # a background cell's: sent to its own cell, in order with its text
        place.display(data, {}, display_id, update=update)
        return
    sockets = output.kernel_sockets()
    if sockets is None:  # not ipykernel's publisher: the ordinary way
        from IPython.display import publish_display_data

        publish_display_data(data, transient=transient or None, update=update)
        return
    session, socket = sockets
    if flush:
        sys.stdout.flush()
        sys.stderr.flush()
    content = {"data": data, "metadata": {}, "transient": transient}
    parent, ident = output.request_header(), b"display_data"
    kind = "update_display_data" if update else "display_data"

    def send(sock):
        session.send(sock, kind, content, parent=parent, ident=ident)

    if not (QUEUED and queue_without_wake(socket, send)):  # the ordinary way: its own wake of the IO thread
        send(socket)


def line_bundle(line: str, chart=None) -> dict:
    """A pool cell's line as display data: its text, and the same in small grey HTML; ``chart``'s below."""
    bundle = {"text/plain": line,
              "text/html": f"<div class='nbddp-line' style='color:{MUTED};font-size:smaller'>{html.escape(line)}</div>"}
    if chart:
        bundle = {"text/plain": bundle["text/plain"] + "\n" + chart.text(),
                  "text/html": bundle["text/html"] + chart.html()}
    return bundle


def unsent() -> bool:
    """Whether the kernel's streams hold text not sent yet (ipykernel's: a flush is pending). Text written
    once nothing is pending wakes the IO thread, so a line queued before it goes out first. (ipykernel's
    OutStream's ``_flush_pending``; a stream without it is flushed: the order kept, at a flush's cost.)"""
    return any(getattr(s, "_flush_pending", True) for s in (sys.stdout, sys.stderr))


def queue_without_wake(socket, send) -> bool:
    """``send(sock)`` made on ipykernel's IO thread (``sock``: its own iopub socket) with its next wake, in
    order with the kernel's other messages; False, with nothing queued, where it cannot be (not ipykernel's
    IOPubThread, or its thread ended): the caller sends the ordinary way. The one use of ipykernel's private
    internals (``IOPubThread._events``, ``_handle_event``, ``io_loop.call_later``): nothing else here names
    them, and ipykernel changing them costs the wake only (``_queueable`` checks them once per thread)."""
    io_thread = getattr(socket, "io_thread", None)
    later = _later(io_thread)
    if later is None:
        return False

    def call():
        if io_thread.socket is not None:  # (None once the kernel is shutting down)
            send(io_thread.socket)

    later.queue(call)
    return True


def _queueable(io_thread) -> bool:
    """ipykernel's IOPubThread (6.x and 7.x alike): a queue of calls its thread makes in order on a wake."""
    return (callable(getattr(io_thread, "schedule", None)) and hasattr(io_thread, "socket")
            and hasattr(getattr(io_thread, "_events", None), "append")
            and callable(getattr(io_thread, "_handle_event", None))
            and callable(getattr(getattr(io_thread, "thread", None), "is_alive", None))
            and callable(getattr(getattr(io_thread, "io_loop", None), "call_later", None)))


class _Later:
    """Calls queued on one IO thread without a wake, and the tick that sends what nothing else did."""

    def __init__(self, io_thread):
        self.io_thread = io_thread
        self.lock = threading.Lock()
        self.ticking = False
        self.queued = self.done = 0
        self.last = 0.0  # when the last call was queued

    def queue(self, call) -> None:
        def run():
            call()
            self.done += 1  # (on the IO thread only)

        with self.lock:
            self.queued += 1
            self.last = time.monotonic()
            self.io_thread._events.append(run)
            if self.ticking:
                return
            self.ticking = True
        self.io_thread.schedule(self._next_tick)  # the one wake: it sends the line and starts the tick

    def _next_tick(self) -> None:
        """On the IO thread: the tick in ``LATE_S`` (a timer of its loop, outside its event handling)."""
        self.io_thread.io_loop.call_later(LATE_S, self._tick)

    def _tick(self) -> None:
        """What is still queued goes out (all of it, in order, as on a wake)."""
        if self.done < self.queued:
            self.io_thread._handle_event(None)
        with self.lock:
            if time.monotonic() - self.last > IDLE_S and self.done >= self.queued:
                self.ticking = False
                return
        self._next_tick()


_LATER: dict[int, _Later] = {}


def _later(io_thread) -> _Later | None:
    """The queue on ``io_thread`` (checked once per thread); None where there is none, or its thread ended."""
    got = _LATER.get(id(io_thread))
    if got is None or got.io_thread is not io_thread:
        if not _queueable(io_thread):
            return None
        got = _LATER[id(io_thread)] = _Later(io_thread)
    return got if io_thread.thread.is_alive() else None
