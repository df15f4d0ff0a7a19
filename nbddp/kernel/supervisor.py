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

import dataclasses
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
    """The ranks' one select loop. Its listeners: ``lifelong`` (given once: the gang's log, its view), and a
    cell's own, given at ``begin_cell`` for that cell only (the relay, the cell's dashboard, the engine)."""

    def __init__(self, lifelong=()):
        self._lifelong = list(lifelong)
        self.bus = Bus(self._lifelong)
        self.tick: float | None = None  # seconds between Tick events (a dashboard's redraw): a cell's
        self.procs: list[RankProc] = []
        self.sel = selectors.DefaultSelector()
        self.kill_at: float | None = None
        self.timed_out: list[int] = []
        self._stacks_until: float | None = None  # collecting stacks (after --timeout, or a probe)
        self._stacks_end = 0.0
        self._stacks_then = None  # what to do once the stacks asked for are in
        self._exits_seen = 0
        self.on_timeout = self.stop_all  # what --timeout does once the stacks are in (a pool interrupts)
        # an interrupt from another thread (%ddp interrupt, for a background cell's loop): a flag and a wake
        self._interrupt = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, (None, "wake"))

    def begin_cell(self, listeners=(), *, tick: float | None = None, on_timeout=None) -> None:
        """A cell's listeners after the lifelong ones, its tick and its --timeout rule (``on_timeout``,
        default: stop every rank); none of the last cell's deadline state (a stack collection still running
        when every rank answered must not interrupt this one), nor what each rank said in it."""
        self.bus = Bus([*self._lifelong, *listeners])
        self.tick = tick
        self.on_timeout = on_timeout or self.stop_all
        self.timed_out = []
        self._stacks_until = self._stacks_then = None
        self._interrupt = False  # (one asked between cells, as the last ended, is for that one)
        for p in self.procs:  # what a rank said in earlier cells must not explain how this one ends
            p.records.clear()

    def end_cell(self) -> None:
        """Only the lifelong listeners again (a pool's stop: no cell is there to show its ranks' last words)."""
        self.bus = Bus(self._lifelong)

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

    def unwatch(self, fd: int) -> None:
        self.sel.unregister(fd)

    def announce(self) -> None:
        """Tell the subscribers about every rank, once all are forked."""
        for proc in self.procs:
            if proc.here:  # (a pid on another machine means nothing to this one's monitor)
                self.bus.publish(Started(proc.rank, proc.pid))

    def all_fds(self) -> list[int]:
        """The kernel's descriptors a rank forked now must not inherit."""
        return [fd for p in self.procs for fd in (*p.fds, p.exit_fd)] + [self._wake_r, self._wake_w]

    def interrupt(self) -> None:
        """From any thread: the loop raises KeyboardInterrupt in the thread that runs it, as Jupyter's
        interrupt does on the main thread (a background cell's ``%ddp interrupt``)."""
        self._interrupt = True
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # already woken (or closed: the gang has ended)

    def live(self) -> list[RankProc]:
        return [p for p in self.procs if p.exit is None]

    def wait(self, deadline: float | None, until=None, wake_at: float | None = None) -> None:
        """Until every rank has exited, or ``until()`` holds (checked after each batch of events and at
        ``wake_at``). ``deadline``: --timeout (stacks, then ``on_timeout``), a time or a function giving
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
                self.timed_out = self.request_stacks(then=lambda: self.on_timeout())
                expired = True
            if self._stacks_until is not None and now >= min(self._stacks_until, self._stacks_end):
                then, self._stacks_until, self._stacks_then = self._stacks_then, None, None
                if then is not None:
                    then()
            if self.kill_at is not None and now >= self.kill_at:
                self._kill_live()
            if next_tick is not None and now >= next_tick:
                self.bus.publish(Tick())
                next_tick = now + self.tick

    def _event(self, proc: RankProc, kind: str, fd: int) -> None:
        if kind == "wake":
            while _read(fd):
                pass
            if self._interrupt:
                self._interrupt = False
                raise KeyboardInterrupt
            return
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
            if kind == "stderr":
                self._stacks_arriving()
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
        # "stopped" only if our signal ended it (a rank that reported its own end did not). A rank still
        # starting when --timeout asked for stacks dies of that SIGUSR1: stopped, too.
        self.ended(proc, failure.exit_record(
            proc.rank, proc.records, code=os.waitstatus_to_exitcode(status),
            stopped=proc.stop_sent or proc.rank in self.timed_out,
            max_rss=usage.ru_maxrss * 1024, seen=time.time(),
        ))

    def ended(self, proc: RankProc, record: failure.RankExit) -> None:
        """``proc`` has ended as ``record`` says (reaped here, or reported by a cluster pool's agent): its
        place in the order of exits and its node are added, the subscribers told; a failure stops the rest."""
        self._exits_seen += 1
        proc.exit = dataclasses.replace(record, order=self._exits_seen, node=proc.node)
        self.bus.publish(Exited(proc.rank, proc.exit))
        if failure.failed(proc.exit) and not proc.stop_sent:
            self.stop_all()

    def feed(self, proc: RankProc, event) -> None:
        """An event of a rank this loop does not read itself (a cluster pool's, from its agent), handled as
        its own would be: a record kept, an exit recorded, stderr extending a stack collection."""
        if proc.exit is not None:
            return
        if isinstance(event, Exited):
            self.ended(proc, event.exit)
            return
        if isinstance(event, Output) and event.stream == "stderr":
            self._stacks_arriving()
        elif isinstance(event, Message):
            proc.records[type(event.record)] = event.record
        self.bus.publish(event)

    def _stacks_arriving(self) -> None:
        if self._stacks_until is not None:  # a stack dump still arriving: the collection goes on
            self._stacks_until = time.monotonic() + STACK_QUIET_S

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

    def request_stacks(self, ranks: list[int] | None = None, then=None) -> list[int]:
        """Ask every live rank (or those of ``ranks``) for its Python stack (faulthandler on SIGUSR1, to its
        stderr); the loop goes on collecting stderr until it is quiet, then calls ``then()``. Returns the
        ranks asked."""
        asked = [p for p in self.live() if ranks is None or p.rank in ranks]
        ranks = [p.rank for p in asked]
        self.bus.publish(StacksRequested(ranks))
        for p in asked:
            p.signal(signal.SIGUSR1)
        now = time.monotonic()
        self._stacks_until = now + STACK_QUIET_S
        self._stacks_end = now + STACK_MAX_S
        self._stacks_then = then
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
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1


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
