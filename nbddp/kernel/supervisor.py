"""Supervising ranks from the kernel's main thread: one select loop, and typed events out.

The loop waits on events only: each rank's stdout/stderr pipes, its channel, and its pidfd (readable
the instant the process exits; where a platform has no pidfds, a "life pipe" the rank holds open,
which reads EOF when it exits). Its only timeouts are real deadlines (``--timeout``, the stack
collection that follows it, the SIGTERM -> SIGKILL grace, the dashboard's 1 Hz tick), so no polling
interval ever lands in the user's wait.

What it sees it publishes on a ``Bus`` as the events below; the relay, the log writer, the dashboard
and the timeout report subscribe (a method ``on_<Event>``) and never reach into each other.
"""
from __future__ import annotations

import functools
import os
import selectors
import signal
import time
from dataclasses import dataclass, field

from ..wire import framing, messages
from . import failure

GRACE_S = 3.0  # SIGTERM -> SIGKILL, like torch.elastic
STACK_QUIET_S = 0.3  # after SIGUSR1 at a timeout: stacks are complete once stderr is quiet this long
STACK_MAX_S = 2.0


# -- events -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    rank: int
    pid: int


@dataclass(frozen=True)
class Output:
    rank: int
    stream: str  # "stdout" | "stderr"
    data: bytes


@dataclass(frozen=True)
class OutputClosed:
    rank: int
    stream: str


@dataclass(frozen=True)
class Message:
    """A record from the rank's channel (messages.Ready, Display, ClearOutput, Result, Error, Exit, Done)."""

    rank: int
    record: object


@dataclass(frozen=True)
class Exited:
    rank: int
    exit: failure.RankExit


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class StacksRequested:
    ranks: list


EVENTS = (Started, Output, OutputClosed, Message, Exited, Tick, StacksRequested)


class Bus:
    """Delivers each event to the subscribers that have an ``on_<EventName>`` method, in order."""

    def __init__(self, subscribers=()):
        self._handlers = {cls: [] for cls in EVENTS}
        for sub in subscribers:
            self.subscribe(sub)

    def subscribe(self, sub) -> None:
        for cls, name in _handled(type(sub)):  # (a pool cell wires ~7 subscribers: looked up once per class)
            handler = getattr(sub, name, None)
            if handler is not None:
                self._handlers[cls].append(handler)

    def publish(self, event) -> None:
        for handler in self._handlers[type(event)]:
            handler(event)


@functools.cache
def _handled(kind: type) -> tuple:
    """The events a subscriber class may handle, each with its method's name: those it defines, or every
    event for a class that answers some by ``__getattr__`` (failure.StackCapture, in front of a relay)."""
    dynamic = hasattr(kind, "__getattr__")
    return tuple((cls, f"on_{cls.__name__}") for cls in EVENTS if dynamic or hasattr(kind, f"on_{cls.__name__}"))


# records a rank sends after flushing its streams: its text written before them is shown before them
# (a Mark is sent when the rank's writes switch between stdout and stderr, and does nothing else)
ORDERED = (messages.Mark, messages.Display, messages.ClearOutput, messages.Result, messages.Error, messages.Exit)


# -- ranks as the kernel sees them -----------------------------------------------------------------
@dataclass
class RankProc:
    rank: int
    pid: int
    exit_fd: int  # a pidfd, or the read end of the rank's life pipe
    fds: dict = field(default_factory=dict)  # fd -> "stdout" | "stderr" | "channel"
    reader: framing.Reader = field(default_factory=framing.Reader)
    records: dict = field(default_factory=dict)  # record class -> the last one of that kind
    held: dict = field(default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()})  # read, not yet published
    published: dict = field(default_factory=lambda: {"stdout": 0, "stderr": 0})  # bytes published per stream
    exit: failure.RankExit | None = None
    stop_sent: bool = False
    here: bool = True  # a process of this machine (a cluster pool's rank on another node is not: remote.py)
    node: str = ""  # a cluster pool's: the node it runs on, as its exit record names it

    def signal(self, sig: int, group: bool = True) -> None:
        """``sig`` to the rank (and, ``group``, the processes it started)."""
        if group:
            _signal_group(self.pid, sig)
        else:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def fd_of(self, stream: str) -> int | None:
        for fd, kind in self.fds.items():
            if kind == stream:
                return fd
        return None


class Supervisor:
    def __init__(self, bus: Bus, tick: float | None = None):
        self.bus = bus
        self.tick = tick
        self.procs: list[RankProc] = []
        self.sel = selectors.DefaultSelector()
        self.kill_at: float | None = None
        self.timed_out: list[int] = []
        self._stacks_until: float | None = None  # collecting stacks after --timeout
        self._stacks_end = 0.0
        self._seen = 0
        self.after_stacks = self.stop_all  # what --timeout does once the stacks are in (a pool interrupts)

    def new_cell(self) -> None:
        """A pool's next cell starts with none of the last one's deadline state (a stack collection still
        running when every rank answered must not interrupt this one)."""
        self.timed_out = []
        self._stacks_until = None

    def add(self, proc: RankProc) -> None:
        self.procs.append(proc)
        for fd, kind in proc.fds.items():
            os.set_blocking(fd, False)  # the kernel's ends only: a drain must never wait
            self.sel.register(fd, selectors.EVENT_READ, (proc, kind))
        if proc.exit_fd >= 0:
            self.sel.register(proc.exit_fd, selectors.EVENT_READ, (proc, "exit"))

    def watch(self, fd: int, callback) -> None:
        """``callback()`` whenever ``fd`` is readable, in the loop (a cluster pool's events from other nodes)."""
        os.set_blocking(fd, False)
        self.sel.register(fd, selectors.EVENT_READ, (callback, "source"))

    def announce(self) -> None:
        """Tell the subscribers about every rank, once all are forked."""
        for proc in self.procs:
            if proc.here:  # (a pid on another machine means nothing to this one's monitor)
                self.bus.publish(Started(proc.rank, proc.pid))

    def all_fds(self) -> list[int]:
        return [fd for p in self.procs for fd in (*p.fds, p.exit_fd)]

    def live(self) -> list[RankProc]:
        return [p for p in self.procs if p.exit is None]

    def wait(self, deadline: float | None, until=None, wake_at: float | None = None) -> None:
        """Until every rank has exited, or ``until()`` holds (checked after each batch of events and at
        ``wake_at``). ``deadline``: --timeout (stacks, then ``after_stacks``), a time or a function giving
        it (it moves on by a debugging pause: the time a rank's prompt waited for the user)."""
        next_tick = time.monotonic() + self.tick if self.tick else None
        expired = False
        while self.live() and not (until and until()):
            now = time.monotonic()
            dl = None if expired else deadline() if callable(deadline) else deadline
            stacks_at = min(self._stacks_until, self._stacks_end) if self._stacks_until is not None else None
            woken = wake_at() if callable(wake_at) else wake_at
            wake = [t for t in (dl, self.kill_at, next_tick, stacks_at, woken) if t is not None]
            timeout = max(0.0, min(wake) - now) if wake else None
            for key, _ in self.sel.select(timeout):
                self._event(*key.data, key.fd)
            now = time.monotonic()
            if dl is not None and now >= dl and self.live() and not self.timed_out and not (until and until()):
                self._expire(now)
                expired = True
            if self._stacks_until is not None and now >= min(self._stacks_until, self._stacks_end):
                self._stacks_until = None
                self.after_stacks()
            if self.kill_at is not None and now >= self.kill_at:
                self._kill_live()
            if next_tick is not None and now >= next_tick:
                self.bus.publish(Tick())
                next_tick = now + self.tick

    def _event(self, proc: RankProc, kind: str, fd: int) -> None:
        if kind == "source":
            proc()  # a watched fd's callback
            return
        if (kind == "exit" and proc.exit is not None) or (kind != "exit" and fd not in proc.fds):
            return  # closed earlier in this same batch of events (the rank's exit drained it)
        if kind == "exit":
            self._exited(proc)
            return
        data = _read(fd)
        if data:
            self._data(proc, kind, data)
        elif data is not None:
            self._close_fd(proc, fd)

    def _data(self, proc: RankProc, kind: str, data: bytes) -> None:
        """Text is held until the records the rank sent before it are known (each frame carries how much
        text the rank had written when it was sent), so the two pipes merge in the rank's own order."""
        if kind == "channel":
            records = proc.reader.feed(data)
        else:
            if self._stacks_until is not None and kind == "stderr":
                self._stacks_until = time.monotonic() + STACK_QUIET_S
            proc.held[kind] += data
            records = self._drain_channel(proc)  # whatever the rank sent before this text is there now
        while records:
            for record, marks in records:
                if isinstance(record, ORDERED):
                    for stream, mark in zip(("stdout", "stderr"), marks):
                        self._publish_text(proc, stream, mark)
                if type(record) is messages.Mark:  # only orders the text: nobody subscribes to it
                    continue
                proc.records[type(record)] = record
                self.bus.publish(Message(proc.rank, record))
            records = self._drain_channel(proc)
        for stream in ("stdout", "stderr"):
            self._publish_text(proc, stream, None)

    def _drain_channel(self, proc: RankProc) -> list:
        fd = proc.fd_of("channel")
        records = []
        while fd is not None and (data := _read(fd)):
            records += proc.reader.feed(data)
        return records

    def _publish_text(self, proc: RankProc, stream: str, mark: int | None) -> None:
        """Publish what is held of ``stream``, up to byte ``mark`` of the rank's writes (None: all)."""
        held = proc.held[stream]
        if mark is not None:
            if proc.published[stream] + len(held) < mark:  # (a quiet rank's marks are all reached: no read)
                fd = proc.fd_of(stream)
                while fd is not None and proc.published[stream] + len(held) < mark and (data := _read(fd)):
                    held += data  # flushed before the record was sent: it is in the pipe
            n = max(0, min(len(held), mark - proc.published[stream]))
        else:
            n = len(held)
        if n:
            chunk = bytes(held[:n])
            del held[:n]
            proc.published[stream] += n
            self.bus.publish(Output(proc.rank, stream, chunk))

    def _close_fd(self, proc: RankProc, fd: int) -> None:
        kind = proc.fds.pop(fd)
        self.sel.unregister(fd)
        os.close(fd)
        if kind != "channel":
            self.bus.publish(OutputClosed(proc.rank, kind))

    def _exited(self, proc: RankProc) -> None:
        # Everything the rank wrote is in its pipes now; a grandchild may hold them open, so drain
        # what is there instead of waiting for EOF. The group dies before the reap (pid still reserved).
        for fd in sorted(proc.fds, key=lambda f: proc.fds[f] == "channel"):  # text first: marks place it
            while data := _read(fd):
                self._data(proc, proc.fds[fd], data)
        for fd in list(proc.fds):
            self._close_fd(proc, fd)
        _signal_group(proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
        self.sel.unregister(proc.exit_fd)
        os.close(proc.exit_fd)
        proc.exit_fd = -1
        self._seen += 1
        # "stopped" only if our signal ended it (a rank that reported its own end did not). A rank still
        # starting when --timeout asked for stacks dies of that SIGUSR1: stopped, too.
        proc.exit = failure.exit_record(
            proc.rank, proc.records, code=os.waitstatus_to_exitcode(status),
            stopped=proc.stop_sent or proc.rank in self.timed_out, order=self._seen,
            max_rss=usage.ru_maxrss * 1024, seen=time.time(), node=proc.node,
        )
        self.bus.publish(Exited(proc.rank, proc.exit))
        if failure.failed(proc.exit) and not proc.stop_sent:
            self.stop_all()

    def stop_all(self) -> None:
        """SIGTERM every live rank (and its children); SIGKILL after the grace period."""
        for p in self.live():
            if not p.stop_sent:
                p.stop_sent = True
                p.signal(signal.SIGTERM)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + GRACE_S

    def _kill_live(self) -> None:
        for p in self.live():
            p.signal(signal.SIGKILL)
        self.kill_at = None

    def _expire(self, now: float) -> None:
        """--timeout: every live rank's stack, then ``after_stacks``."""
        self.timed_out = self.request_stacks()

    def request_stacks(self, ranks: list[int] | None = None) -> list[int]:
        """Ask every live rank (or those of ``ranks``) for its Python stack (faulthandler on SIGUSR1, to its
        stderr); the loop goes on collecting stderr until it is quiet, then calls ``after_stacks`` (stop
        all). Returns the ranks asked."""
        asked = [p for p in self.live() if ranks is None or p.rank in ranks]
        ranks = [p.rank for p in asked]
        self.bus.publish(StacksRequested(ranks))
        for p in asked:
            p.signal(signal.SIGUSR1)
        now = time.monotonic()
        self._stacks_until = now + STACK_QUIET_S
        self._stacks_end = now + STACK_MAX_S
        return ranks

    def signal_live(self, sig: int) -> None:
        """Every live rank and the processes it started (its process group)."""
        for p in self.live():
            p.signal(sig)

    def reap(self) -> None:
        """After an interrupt or an error in the parent: wait for every rank, escalating to SIGKILL."""
        while self.live():
            try:
                self.wait(None)
            except KeyboardInterrupt:
                self._kill_live()

    def close(self) -> None:
        for p in self.procs:
            for fd in list(p.fds):
                self._close_fd(p, fd)
            if p.exit_fd >= 0:
                self.sel.unregister(p.exit_fd)
                os.close(p.exit_fd)
                p.exit_fd = -1
        self.sel.close()


def _read(fd: int) -> bytes | None:
    """What the pipe holds now: bytes, b"" at EOF, None when empty for the moment."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
