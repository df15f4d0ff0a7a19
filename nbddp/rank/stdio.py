"""A rank's own stdout and stderr: new Python streams on fd 1/2 that count what they wrote (the marks
each channel frame carries), keep the order the rank wrote the two streams in (a ``Mark`` on a switch,
within a ``Budget``), and push block-buffered stdout out every ``FLUSH_S``.
"""
from __future__ import annotations

import ctypes
import io
import itertools
import os
import sys
import time

from ..wire import framing
from ..wire.budget import Budget
from . import metrics_log


def flush_streams() -> None:
    """Before a record that ends something: the text written before it reaches the pipes first, and what
    ``nbddp.log`` queued before it, the channel (rank/metrics_log.py)."""
    flush_each(sys.stdout, sys.stderr)
    metrics_log.flush()


def flush_each(*streams) -> None:
    """Each of ``streams`` flushed, in turn, whatever it is now (``sys.stdout``, ``sys.stderr``): one that fails
    changes nothing."""
    for stream in streams:
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream, or one the user's code put there: nothing to push
            pass


class CountingFileIO(io.FileIO):
    """fd 1/2 for Python's streams, counting what they wrote: the marks each channel frame carries."""

    written = 0
    order = None  # the rank's StreamOrder: told before each write

    def write(self, b):
        if self.order is not None:
            self.order.before(self)
        n = super().write(b)
        self.written += n or 0
        return n


class StreamOrder:
    """stdout and stderr in the order the rank's Python code wrote them. stdout is block-buffered, so
    before stderr is written, what stdout holds goes out first; and when the writes switch from one
    stream to the other, a ``messages.Mark`` goes first: the kernel reads the two pipes in whatever
    order they become readable, and the mark tells it which text came before (within a Budget). A
    rank that writes one stream only never sends one. Processes the rank forks (DataLoader workers)
    send none: their counts are not the rank's."""

    def __init__(self, chan: framing.Writer, stdout: io.TextIOWrapper):
        self.chan, self.stdout = chan, stdout
        self.last = None  # the raw stream written last
        self.budget = Budget()  # past it, no Marks: the streams interleave as the pipes deliver them

    def install(self) -> None:
        RAW[1].order = RAW[2].order = self
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        RAW[1].order = RAW[2].order = None

    def before(self, raw: CountingFileIO) -> None:
        if raw is RAW[2]:
            try:
                self.stdout.flush()  # print("a"); print("b", file=sys.stderr): "a" first
            except (OSError, ValueError, RuntimeError):  # the pipe gone, the stream closed, or a write from
                pass  # inside a stdout write (a signal handler, a finaliser: "reentrant call")
        if self.last is not raw:
            if self.last is not None and self.budget.take():
                try:
                    self.chan.mark()
                except OSError:  # the kernel is gone: the text still goes to the pipe, or fails there
                    pass
            self.last = raw


RAW: dict[int, CountingFileIO] = {}


def marks() -> tuple[int, int]:
    return tuple(RAW[fd].written if fd in RAW else 0 for fd in (1, 2))


LIBC = ctypes.CDLL(None, use_errno=True)  # this process's C library: prctl, setvbuf, fflush
# posix's own fork and posix_spawn, not os's: the kernel's debugger (debugpy) replaces those, its fork with one
# that holds the child until a debugger attaches, its posix_spawn with one that starts the child under the
# debugger from its first line (a spawned rank took 39 s to reach a breakpoint); a rank connects at its cell
# instead while the panel is on (rank/debugpanel.py). os where there is no posix module (options.py refuses it).
POSIX = sys.modules.get("posix", os)


def _stream(fd: int, line_buffering: bool) -> io.TextIOWrapper:
    raw = RAW[fd] = CountingFileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(io.BufferedWriter(raw, 1 << 16), encoding="utf-8", errors="backslashreplace",
                            line_buffering=line_buffering)


FLUSH_S = 0.05


def _start_flusher() -> None:
    """stdout is block-buffered (one write per 64 KiB, not per line: a chatty rank costs its parent
    and its own loop far less); this thread pushes what is pending every 50 ms, so output stays live,
    and what ``nbddp.log`` queued every ``metrics_log.SEND_S`` (one batch: rank/metrics_log.py). stderr stays
    line-buffered: warnings and errors go out at once."""
    import threading

    def flush_forever():
        batch_every = max(1, round(metrics_log.SEND_S / FLUSH_S))
        for tick in itertools.count(1):
            time.sleep(FLUSH_S)
            flush_each(getattr(sys, "stdout", None))  # (None: a rank's code deleted it; nothing to push)
            if tick % batch_every == 0:
                metrics_log.flush()  # (never raises; nothing to send outside a rank: a DataLoader worker)

    threading.Thread(target=flush_forever, name="nbddp-flush", daemon=True).start()


def _line_buffer_c_stdout() -> None:
    try:
        for name in ("stdout", "stderr"):
            LIBC.setvbuf(ctypes.c_void_p.in_dll(LIBC, name), None, 1, 0)  # _IOLBF
    except (OSError, ValueError, AttributeError):
        pass


def install(chan: framing.Writer) -> tuple:
    """New Python streams on fd 1/2 (stdin: /dev/null), ordered and flushed; returns the kernel's
    streams they replace."""
    kernel_streams = (sys.stdout, sys.stderr)
    sys.stdout = sys.__stdout__ = _stream(1, line_buffering=False)
    sys.stderr = sys.__stderr__ = _stream(2, line_buffering=True)
    StreamOrder(chan, sys.stdout).install()
    metrics_log.install(chan)  # nbddp.log's calls go out on the channel
    sys.stdin = sys.__stdin__ = open(os.devnull)  # (open for the rank's whole life)
    _start_flusher()
    os.register_at_fork(after_in_child=_start_flusher)  # DataLoader workers forked by the rank
    _line_buffer_c_stdout()
    return kernel_streams
