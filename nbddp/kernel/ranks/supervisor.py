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
import heapq
import itertools
import os
import select
import selectors
import signal
import time
from dataclasses import dataclass, field

from ... import timeline
from ...hw import procwait
from ...wire import framing, messages
from ..debugger import rankdebug
from . import failure
from .stacks import StackRequest


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
    stopped: frozenset = frozenset()  # pids of ranks stopped in JupyterLab's debugger panel now (rankdebug.py)


@dataclass(frozen=True)
class StacksRequested:
    ranks: list


@dataclass(frozen=True)
class Moved:
    """The pool's ranks moved (membership.Membership, the one authority: a shrink, a resize): rank ``old`` is
    rank ``moves[old]`` from now on (a rank not in ``moves`` left), the ranks of ``added`` are new (a grow, forked
    next); all of them in the process group's ``generation``, ``world_size`` ranks, on ``device_ids``."""

    generation: int
    moves: dict
    world_size: int
    device_ids: tuple = ()
    added: tuple = ()


EVENTS = (Started, Output, OutputClosed, Message, Exited, Tick, StacksRequested, Moved)


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
    event for a class that answers some by ``__getattr__`` (stacks.StackCapture, in front of a relay)."""
    dynamic = hasattr(kind, "__getattr__")
    return tuple((cls, f"on_{cls.__name__}") for cls in EVENTS if dynamic or hasattr(kind, f"on_{cls.__name__}"))


# records a rank sends after flushing its streams: its text written before them is shown before them
# (a Mark is sent when the rank's writes switch between stdout and stderr, and does nothing else)
ORDERED = (messages.Mark, messages.Display, messages.ClearOutput, messages.Progress, messages.Result, messages.Error,
           messages.Exit)


# -- ranks as the kernel sees them -----------------------------------------------------------------
@dataclass
class RankProc:
    rank: int
    pid: int
    exit_fd: int  # a pidfd, or the read end of the rank's life pipe
    fds: dict = field(default_factory=dict)  # fd -> "stdout" | "stderr" | "channel"
    reader: framing.Reader = field(default_factory=framing.Reader)
    records: dict = field(default_factory=dict)  # record class -> the last one of that kind
    # read, not yet published
    held: dict = field(default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()})
    published: dict = field(default_factory=lambda: {"stdout": 0, "stderr": 0})  # bytes published per stream
    exit: failure.RankExit | None = None
    stop_sent: bool = False
    here: bool = True  # a process of this machine (a cluster pool's rank on another node is not: remote.py)
    node: str = ""  # a cluster pool's: the node it runs on, as its exit record names it
    reap: object = None  # a rank that is not the kernel's child (the forkserver's): () -> (wait status, peak RSS)
    pidfd: bool = True  # exit_fd is its pidfd (no pidfds here, as on macOS: its life pipe)
    store_fds: tuple = ()  # the kernel's ends of its store pipes (request read, reply write), where it has them
    replaying: bool = False  # what a keeper kept is being fed (taking._replay): its pipes, newer, are not read now

    def signal(self, sig: int, group: bool = True) -> None:
        """``sig`` to the rank (and, ``group``, the processes it started). Its number, and its group's, may have
        gone to another process once it was reaped (a forkserver's rank is reaped by the server, maybe before
        the kernel handled its end; the server killed its group first): so its pidfd says first whether it is
        still there (a zombie is: its numbers are still its own), and the rank itself is signalled by it. Once
        its end was handled (``exit_fd`` -1), nothing."""
        if self.exit_fd < 0:
            return
        try:
            if self.pidfd:
                signal.pidfd_send_signal(self.exit_fd, 0)  # ProcessLookupError: reaped
            if group:
                try:
                    os.killpg(self.pid, sig)
                    return
                except (ProcessLookupError, PermissionError):  # not its group's leader yet
                    pass
            if self.pidfd:
                signal.pidfd_send_signal(self.exit_fd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def ended_unread(self) -> bool:
        """The rank has ended, and the kernel has not read its end yet (its pidfd, or its life pipe, is readable)."""
        if self.exit_fd < 0:
            return False
        poll = select.poll()
        poll.register(self.exit_fd, select.POLLIN)
        return bool(poll.poll(0))

    def look(self):
        """How the rank is now, as /proc tells (a procwait.Look; None where it cannot): kernel/cells/grace.py."""
        return procwait.look(self.pid)

    def fd_of(self, stream: str) -> int | None:
        """Its ``stream`` pipe, to read from here and now (none while what a keeper kept is replayed)."""
        if self.replaying:
            return None
        for fd, kind in self.fds.items():
            if kind == stream:
                return fd
        return None

    def drain_channel(self) -> list:
        """The records its channel holds now."""
        fd = self.fd_of("channel")
        records = []
        while fd is not None and (data := _read(fd)):
            records += self.reader.feed(data)
        return records

    def text_upto(self, stream: str, mark: int | None) -> bytes:
        """What is held of ``stream`` up to byte ``mark`` of the rank's writes (None: all), taken; text flushed
        before a record was sent is in the pipe, and read here if not yet."""
        held = self.held[stream]
        if self.published[stream] is None:  # a rank taken from a kept pool: what it wrote before is learnt from
            if mark is None:  # the first record it sends (its marks count from its start)
                chunk = bytes(held)
                held.clear()
                return chunk
            self.published[stream] = max(0, mark - len(held))
        if mark is not None:
            if self.published[stream] + len(held) < mark:  # (a quiet rank's marks are all reached: no read)
                fd = self.fd_of(stream)
                while fd is not None and self.published[stream] + len(held) < mark and (data := _read(fd)):
                    held += data
            n = max(0, min(len(held), mark - self.published[stream]))
        else:
            n = len(held)
        chunk = bytes(held[:n])
        del held[:n]
        self.published[stream] += n
        return chunk


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
        self.collecting: StackRequest | None = None  # stacks asked for (after --timeout, an interrupt, a probe)
        self.schedule = Schedule()  # the cell's timed actions (``at``)
        self._exits_seen = 0
        self.on_timeout = self.stop_all  # what --timeout does once the stacks are in (a pool interrupts)
        self._waker = Waker(self.sel)  # an interrupt from another thread (a background cell's %ddp interrupt)
        self.on_loss = None  # a pool's options.OnLoss (another node's: KERNEL_DECIDES); None: one-shot, peers stopped

    def begin_cell(self, listeners=(), *, tick: float | None = None, on_timeout=None) -> None:
        """A cell's listeners after the lifelong ones, its tick and its --timeout rule (``on_timeout``,
        default: stop every rank); none of the last cell's deadline state (a stack collection still running
        when every rank answered must not interrupt this one), nor what each rank said in it."""
        self.bus = Bus([*self._lifelong, *listeners])
        self.tick = tick
        self.on_timeout = on_timeout or self.stop_all
        self.timed_out = []
        self.collecting = None
        self.schedule = Schedule()  # (the last cell's: its rules are not this one's)
        self._waker.pending = False  # (an interrupt asked between cells, as the last ended, was for that one)
        for p in self.procs:  # what a rank said in earlier cells must not explain how this one ends
            p.records.clear()

    def listen(self, sub) -> None:
        """One more lifelong listener (a pool's record of its lost ranks)."""
        self._lifelong.append(sub)
        self.bus.subscribe(sub)

    def end_cell(self) -> None:
        """Only the lifelong listeners again (a pool's stop: no cell is there to show its ranks' last words)."""
        self.bus = Bus(self._lifelong)
        self.schedule = Schedule()

    def at(self, when: float, action) -> "Timer":
        """``action()`` at ``when`` (time.monotonic), from the loop: the cell's rules register what they do
        when (a failed peer's grace, the health check's limit, a prompt's turn, the probe, the relay's
        releases); dropped with the cell (``begin_cell``, ``end_cell``), or by ``Timer.cancel``."""
        return self.schedule.at(when, action)

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
        return [fd for p in self.procs for fd in (*p.fds, p.exit_fd)] + self._waker.fds()

    def interrupt(self) -> None:
        """From any thread: the loop raises KeyboardInterrupt in the thread that runs it, as Jupyter's
        interrupt does on the main thread (a background cell's ``%ddp interrupt``)."""
        self._waker.interrupt()

    def live(self) -> list[RankProc]:
        return [p for p in self.procs if p.exit is None]

    def wait(self, deadline: float | None, until=None, wake_at: float | None = None) -> None:
        """Until every rank has exited, or ``until()`` holds: a question, with no effect of its own (checked
        after each batch of events and timed actions, and at ``wake_at``). What happens when is on the
        schedule (``at``). ``deadline``: --timeout (stacks, then ``on_timeout``), a time or a function giving
        it (it moves on by a debugging pause: the time a rank's prompt waited for the user)."""
        next_tick = time.monotonic() + self.tick if self.tick else None
        expired = False
        while self.live() and not (until and until()):
            now = time.monotonic()
            dl = None if expired else deadline() if callable(deadline) else deadline
            wake = [t for t in (dl, self.kill_at, next_tick, self.schedule.next(), wake_at) if t is not None]
            timeout = max(0.0, min(wake) - now) if wake else None
            for key, _ in self.sel.select(timeout):
                self._event(*key.data, key.fd)
            now = time.monotonic()
            if dl is not None and now >= dl and self.live() and not self.timed_out and not (until and until()):
                self.timed_out = self.request_stacks(then=lambda: self.on_timeout())
                expired = True
            self.schedule.run(now)
            if self.kill_at is not None and now >= self.kill_at:
                self._kill_live()
            if next_tick is not None and now >= next_tick:
                self.bus.publish(Tick(rankdebug.stopped_pids()))
                next_tick = now + self.tick

    def poll(self, timeout: float = 0.0) -> None:
        """The events there are now (or within ``timeout`` s), handled (a pool between cells, when a rank's pidfd
        says it ended: its exit is known at once, not at the next cell; an agent whose node has no rank left)."""
        for key, _ in self.sel.select(timeout):
            self._event(*key.data, key.fd)

    def _event(self, proc: RankProc, kind: str, fd: int) -> None:
        if kind == "wake":
            self._waker.woken()
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
            self.feed(proc, kind, data)
        elif data is not None:
            self._close_fd(proc, fd)

    def feed(self, proc: RankProc, kind: str, data: bytes) -> None:
        """What ``proc``'s ``kind`` pipe gave (read here, or by a kept pool's keeper while no kernel held it). Text is
        held until the records the rank sent before it are known (each frame carries how much text the rank had
        written when it was sent), so the two pipes merge in the rank's own order."""
        if kind == "channel":
            records = proc.reader.feed(data)
        else:
            if kind == "stderr":
                self.stacks_arriving()
            proc.held[kind] += data
            records = proc.drain_channel()  # whatever the rank sent before this text is there now
        while records:
            for record, marks in records:
                if isinstance(record, ORDERED):
                    for stream, mark in zip(("stdout", "stderr"), marks):
                        self._publish_text(proc, stream, mark)
                if type(record) is messages.Mark:  # only orders the text: nobody subscribes to it
                    continue
                proc.records[type(record)] = record
                self.bus.publish(Message(proc.rank, record))
            records = proc.drain_channel()
        for stream in ("stdout", "stderr"):
            self._publish_text(proc, stream, None)

    def _publish_text(self, proc: RankProc, stream: str, mark: int | None) -> None:
        """Publish what is held of ``stream``, up to byte ``mark`` of the rank's writes (None: all)."""
        chunk = proc.text_upto(stream, mark)
        if chunk:
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
                self.feed(proc, proc.fds[fd], data)
        for fd in list(proc.fds):
            self._close_fd(proc, fd)
        proc.signal(signal.SIGKILL)
        status, max_rss = _reaped(proc)
        self.sel.unregister(proc.exit_fd)
        os.close(proc.exit_fd)
        proc.exit_fd = -1
        # "stopped" only if our signal ended it (a rank that reported its own end did not). A rank still
        # starting when --timeout asked for stacks dies of that SIGUSR1: stopped, too.
        self.ended(proc, failure.exit_record(
            proc.rank, proc.records, code=_exit_code(status, proc),
            stopped=proc.stop_sent or proc.rank in self.timed_out,
            max_rss=max_rss, seen=time.time(),
        ))

    def ended(self, proc: RankProc, record: failure.RankExit) -> None:
        """``proc`` has ended as ``record`` says (reaped here, or reported by a cluster pool's agent): its
        place in the order of exits and its node are added, the subscribers told; a failure stops the rest."""
        self._exits_seen += 1
        proc.exit = dataclasses.replace(record, order=self._exits_seen, node=proc.node)
        self.bus.publish(Exited(proc.rank, proc.exit))
        if failure.failed(proc.exit) and not proc.stop_sent and not (self.on_loss and self.on_loss.keeps_peers):
            self.stop_all()

    def stacks_arriving(self) -> None:
        """A rank's stderr moved: a stack collection under way waits for it to go quiet."""
        if self.collecting is not None:
            self.collecting.arriving()

    def collected(self, request: StackRequest) -> None:
        """``request``'s stacks are in (stacks.py)."""
        if self.collecting is request:
            self.collecting = None

    def stop_all(self) -> None:
        """SIGTERM every live rank (and its children); SIGKILL after the grace period."""
        for p in self.live():
            if not p.stop_sent:
                p.stop_sent = not p.ended_unread()  # (one killed while a peer's report was read: not nbddp's doing)
                p.signal(signal.SIGTERM)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + timeline.GRACE_S

    def _kill_live(self) -> None:
        for p in self.live():
            p.signal(signal.SIGKILL)
        self.kill_at = None

    def request_stacks(self, ranks: list[int] | None = None, then=None) -> list[int]:
        """Ask every live rank (or those of ``ranks``) for its Python stack (faulthandler on SIGUSR1, to its
        stderr); the loop goes on collecting stderr until it is quiet, then calls ``then()``. Returns the
        ranks asked."""
        asked = [p for p in self.live() if ranks is None or p.rank in ranks]
        self.bus.publish(StacksRequested([p.rank for p in asked]))
        self.collecting = StackRequest(self, asked, then)
        return self.collecting.ranks

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
        self._waker.close()


def _exit_code(status: int | None, proc: RankProc) -> int | None:
    """The rank's exit code from its wait status; a rank taken from a kept pool (not this kernel's child: ``status``
    None) said it, or it is unknown (None)."""
    if status is not None:
        return os.waitstatus_to_exitcode(status)
    return 0 if messages.Done in proc.records else None


def _reaped(proc: RankProc) -> tuple[int, int]:
    """A rank's wait status and peak RSS: the kernel's child reaped here, a forkserver's rank by its server."""
    if proc.reap is not None:
        return proc.reap()
    _, status, usage = os.wait4(proc.pid, 0)
    return status, usage.ru_maxrss * 1024


class Schedule:
    """Timed actions, earliest first; each runs once, from the loop (``run``), unless cancelled."""

    def __init__(self):
        self._heap: list = []  # (when, order, Timer)
        self._order = itertools.count()

    def at(self, when: float, action) -> "Timer":
        timer = Timer(when, action)
        heapq.heappush(self._heap, (when, next(self._order), timer))
        return timer

    def next(self) -> float | None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def run(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, timer = heapq.heappop(self._heap)
            if not timer.cancelled:
                timer.cancelled = True
                timer.action()


class Waker:
    """A pipe in the loop's selector: another thread asks for an interrupt (a flag) and wakes the loop,
    which raises KeyboardInterrupt in the thread that runs it."""

    def __init__(self, sel):
        self.pending = False
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        sel.register(self.r, selectors.EVENT_READ, (None, "wake"))

    def fds(self) -> list[int]:
        return [self.r, self.w]

    def interrupt(self) -> None:
        self.pending = True
        try:
            os.write(self.w, b"!")
        except OSError:
            pass  # already woken (or closed: the gang has ended)

    def woken(self) -> None:
        while _read(self.r):
            pass
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def close(self) -> None:
        for fd in (self.r, self.w):
            os.close(fd)
        self.w = -1


class Timer:
    """One action on a supervisor's schedule (``Supervisor.at``)."""

    __slots__ = ("when", "action", "cancelled")

    def __init__(self, when: float, action):
        self.when, self.action, self.cancelled = when, action, False

    def cancel(self) -> None:
        self.cancelled = True


def _read(fd: int) -> bytes | None:
    """What the pipe holds now: bytes, b"" at EOF, None when empty for the moment."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
