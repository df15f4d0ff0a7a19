"""In the kernel: the ranks on other nodes, as the supervisor sees them, fed by their agents' event streams.

The kernel's calls to an agent, and what its stream says besides its ranks' events, are wire/agentmessages.py's
(``Link.control`` sends one, in order). Each agent's ``events`` stream is read by a thread of its own
(``Streams``): store requests are answered there at once (groupstore.Store: the ranks' rendezvous never waits for
the kernel's main thread), every other event is queued and a byte written to a wake pipe the supervisor watches
(``Supervisor.watch``), so the main thread's one loop publishes them on the same bus as local ranks' events, in
each rank's order: the relay, the logs, the dashboard and the failure rules cannot tell the two apart. A stream
that ends before its ranks have (the agent's actor died, its node was lost, or it failed a call of the kernel's)
ends those ranks with a record naming the node; so does a stream silent for ``SILENT_S`` (an agent beats each
``BEAT_S``), which is how a node whose machine stopped answering is known in seconds, not at Ray's own node timeout
(``Streams.listen``).

Signals (an interrupt, ``--timeout``'s stacks, a teardown) go to a remote rank through its agent
(``RemoteProc.signal``), never ``ray.cancel`` (which cannot interrupt a running actor method).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import queue
import threading
import time

from .. import timeline
from ..kernel.ranks import failure
from ..kernel.ranks.supervisor import Exited, Message, Output, RankProc
from ..units import ranks_text
from ..wire import agentmessages, messages

LOST = "NodeLost"


@dataclasses.dataclass(frozen=True)
class StreamEnded:
    """Queued by a node's reader (or the thread that listens for silence) for the main thread: the agent's stream
    ended, fell silent, or said a call failed (``why``; None: it ended on its own)."""

    why: str | None


@dataclasses.dataclass
class RemoteProc(RankProc):
    """A rank on another node: no pipes here; its agent signals it."""

    link: object = None  # the node's Link
    looked: tuple = (0, None)  # (the node's ask it answers, the procwait.Look its agent sent)
    signalled: int = 0  # the node's looks asked before this rank's last signal: they tell nothing of what came after

    def signal(self, sig: int, group: bool = True) -> None:
        self.signalled = self.link.looks_asked
        self.link.control(agentmessages.Signal(self.rank, int(sig), group))

    def look(self):
        """The last look its agent sent, if taken after the last signal (the agent applies the kernel's calls in
        order), else None; and the next one asked for, of all the node's ranks at once (``Link.ask_looks``): it
        comes on the node's stream (kernel/cells/grace.py asks again a moment later)."""
        self.link.ask_looks(since=self.signalled)
        ask, look = self.looked
        return look if ask > self.signalled else None


class Link:
    """The kernel's end of one agent for one pool: its calls in order (a sequence number each)."""

    def __init__(self, actor, node: str, ranks: list[int], pool: str = ""):
        self.actor, self.node, self.ranks, self.pool = actor, node, ranks, pool
        self.slots = len(ranks)  # the ranks its agent's bundle holds (a short last chunk of a grow: fewer)
        self.seq = 0
        self.lock = threading.Lock()
        self.lost: str | None = None
        self.broken = False  # the agent could not apply a call of the kernel's
        self.clean = False  # its stream ended on its own, every rank's exit sent: the agent can serve another pool
        self.heard = time.monotonic()  # its stream's last word (a batch, or its beat)
        self.looks_asked = self.looks_answered = 0  # asks for a look at all its ranks (RemoteProc.look), answers
        self.looks_at = 0.0  # when the last was asked
        # the kernel's renumberings (old rank -> new) the agent has not marked on its stream yet: what the stream
        # says before that mark (queued before the agent applied them) still carries the old numbers
        self.unmarked: collections.deque = collections.deque()

    def current(self, rank: int) -> int:
        """A rank number as this node's stream says it (at this point of it), as the kernel numbers it now: -1
        for a rank that ended before a renumbering (forgotten)."""
        for moves in self.unmarked:
            rank = moves.get(rank, -1)
        return rank

    def ask_looks(self, since: int) -> None:
        """A look at every rank of the node, one Ray call however many ranks it has: asked unless one asked after
        ``since`` (the asking rank's last signal) is still unanswered (for less than ``LOOK_LOST_S``), so at most
        one is in flight per node while the answers keep up."""
        now = time.monotonic()
        in_flight = self.looks_answered < self.looks_asked and self.looks_asked > since
        if in_flight and now - self.looks_at < timeline.LOOK_LOST_S:
            return
        self.looks_asked, self.looks_at = self.looks_asked + 1, now
        self.control(agentmessages.LookAtRanks(self.looks_asked))

    def control(self, call) -> None:
        """``call`` (one of agentmessages.KERNEL_CALLS) to the agent, in an ``AgentCall`` with this link's pool and
        the call's sequence number."""
        if self.lost:
            return
        with self.lock:
            self.seq += 1
            sent = pickle.dumps(agentmessages.AgentCall(self.pool, self.seq, call), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self.actor.control.remote(sent)  # one argument: Ray serialises each one separately
            except Exception:  # noqa: BLE001 - the agent is gone: its stream's end says so
                pass


class Streams:
    """Every agent's event stream, read by one thread each, delivered on the kernel's main thread."""

    def __init__(self, sup, store):
        self.sup, self.store = sup, store
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: collections.deque = collections.deque()  # taken from ``events``, not yet published
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)  # a full pipe is a wake already due: a reader never blocks on it
        self.threads: list[threading.Thread] = []
        self.procs: dict[int, RemoteProc] = {}
        self.links: list[Link] = []
        self.closing = threading.Event()
        sup.watch(self.wake_r, self.deliver)

    def add(self, rank: int, pid: int, link: Link) -> RemoteProc:
        """A rank of ``link``'s node (at the start, or started anew), supervised here as the loop's own."""
        proc = RemoteProc(rank, pid, -1, node=link.node, link=link, here=False)
        self.sup.add(proc)
        self.procs[rank] = proc
        return proc

    def renumber(self, moves: dict) -> None:
        """The pool's ranks moved (old -> new: ``ClusterGang.on_Moved``): the remote ranks of ``moves`` under their
        new numbers, the others forgotten."""
        self.procs = {moves[r]: p for r, p in self.procs.items() if r in moves}

    def follow(self, link: Link, gen) -> None:
        """Read ``gen``, the agent's ``events`` stream (past its first item), on a thread of its own; the
        first link followed starts the thread that listens for silence."""
        link.heard = time.monotonic()
        self.links.append(link)
        t = threading.Thread(target=self._read, args=(link, gen), name=f"nbddp-node-{link.node}", daemon=True)
        t.start()
        if not self.threads:
            threading.Thread(target=self.listen, name="nbddp-node-beats", daemon=True).start()
        self.threads.append(t)

    def listen(self, every: float = 0.5) -> None:
        """Each ``every`` s: a node silent for ``SILENT_S`` is lost, its ranks with it (its reader may wait on
        Ray for much longer). A kernel too busy to run this thread on time heard nobody meanwhile: the silence
        counts from when it could listen again."""
        last = time.monotonic()
        while not self.closing.wait(every):
            now = time.monotonic()
            if now - last > 4 * every:  # this thread was not run: neither were the readers
                for link in self.links:
                    link.heard = max(link.heard, now - every)
            last = now
            for link in self.links:
                if link.lost is None and now - link.heard > timeline.SILENT_S:
                    link.lost = f"no word from its agent for {now - link.heard:.0f} s"
                    self.events.put([(link, StreamEnded(link.lost))])
                    self._wake()

    def _read(self, link: Link, gen) -> None:
        import ray

        why = None
        try:
            for ref in gen:
                link.heard = time.monotonic()
                batch = pickle.loads(ray.get(ref))
                link.heard = time.monotonic()
                rest = self.took(link, batch)
                if rest:
                    self.events.put(rest)
                    self._wake()
        except Exception as e:  # noqa: BLE001 - the actor died, or its node went away
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        link.clean = why is None and not link.broken
        link.lost = why or link.lost or "its agent's stream ended"
        self.events.put([(link, StreamEnded(why))])
        self._wake()

    def took(self, link: Link, batch: list) -> list:
        """On ``link``'s reader thread: a batch of its agent's stream, the store's requests answered at once; the
        rest for the main thread (``_apply``), each (link, what the stream said): a rank's event, the agent's
        ``RankForked``, ``Renumbered`` or ``Looked``, or ``StreamEnded`` for its ``CallFailed``."""
        rest = []
        for item in batch:
            if isinstance(item, agentmessages.StoreRequest):  # (its pid, the asking rank's on its node: the address)
                self.store.handle(item.request,
                                  lambda frame, a=item.pid: link.control(agentmessages.StoreReply(a, frame)))
            elif isinstance(item, agentmessages.CallFailed):  # the agent failed a call: the node is lost
                link.lost, link.broken = item.error, True
                rest.append((link, StreamEnded(item.error)))
            else:
                rest.append((link, item))
        return rest

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def deliver(self) -> None:
        """On the main thread (the supervisor's loop): publish what the streams brought."""
        try:
            while os.read(self.wake_r, 1 << 16):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                self.pending.extend(self.events.get_nowait())
            except queue.Empty:
                break
        try:
            while self.pending:  # one at a time: an interrupt in a subscriber loses none of the rest
                self._apply(self.pending.popleft())
        finally:
            if self.pending:
                self._wake()  # the rest on the loop's next turn

    def _apply(self, entry) -> None:
        """``entry``: (link, what its stream said) as ``took`` or ``listen`` queued it, handled by its type
        (``APPLY``; anything else is a rank's event); a rank's number as the kernel numbers it now."""
        link, item = entry
        APPLY.get(type(item), Streams._rank_event)(self, link, item)

    def _rank_event(self, link: Link, ev) -> None:
        rank = link.current(ev.rank)
        proc = self.procs.get(rank)
        if proc is not None and proc.link is link:  # (not a rank started anew on another node since)
            feed(self.sup, proc, ev if rank == ev.rank else renumbered(ev, rank))

    def _renumbered(self, link: Link, mark: agentmessages.Renumbered) -> None:
        """What the stream says from here on carries the new numbers."""
        if link.unmarked:
            link.unmarked.popleft()

    def _looked(self, link: Link, looked: agentmessages.Looked) -> None:
        link.looks_answered = max(link.looks_answered, looked.ask)
        for rank, look in looked.looks.items():
            proc = self.procs.get(link.current(rank))
            if proc is not None and proc.link is link:
                proc.looked = (looked.ask, look)

    def _forked(self, link: Link, forked: agentmessages.RankForked) -> None:
        """A new rank on that node (a lost one's replacement)."""
        rank = link.current(forked.rank)
        if rank >= 0:
            self.add(rank, forked.pid, link)

    def _ended(self, link: Link, ended: StreamEnded) -> None:
        """An agent's stream ended: its ranks still alive are lost with it."""
        why = ended.why
        for rank in link.ranks:
            proc = self.procs[rank]
            if proc.exit is None and proc.link is link:  # (not a rank started anew on another node since)
                why_lost = f"node {link.node} lost ({ranks_text(link.ranks)})" + (f": {why}" if why else "")
                self.sup.ended(proc, lost_exit(rank, why_lost, stopped=proc.stop_sent))

    def join(self, within: float) -> bool:
        """Whether every reader has ended (waiting ``within`` seconds at most)."""
        end = time.monotonic() + within
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def close(self, within: float = 5.0) -> None:
        """The wake pipe is closed once every reader has ended: a reader still running could otherwise
        write into whatever reused the descriptor (left open if one is still there after ``within``). Once:
        a second call closes nothing."""
        self.closing.set()
        if self.wake_w < 0 or not self.join(within):
            return
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.wake_r = self.wake_w = -1


# what a node's stream says besides its ranks' events -> how the main thread handles it (``Streams._apply``)
APPLY = {
    agentmessages.Renumbered: Streams._renumbered,
    agentmessages.Looked: Streams._looked,
    agentmessages.RankForked: Streams._forked,
    StreamEnded: Streams._ended,
}


def feed(sup, proc, event) -> None:
    """An event of a rank the supervisor's loop does not read itself (from its agent), handled as its own would
    be: a record kept, an exit recorded, stderr extending a stack collection."""
    if proc.exit is not None:
        return
    if isinstance(event, Exited):
        sup.ended(proc, event.exit)
        return
    if isinstance(event, Output) and event.stream == "stderr":
        sup.stacks_arriving()
    elif isinstance(event, Message):
        proc.records[type(event.record)] = event.record
    sup.bus.publish(event)


def renumbered(event, rank: int):
    """An event of a rank's, as the kernel numbers that rank now (its exit record too)."""
    if isinstance(event, Exited):
        return dataclasses.replace(event, rank=rank, exit=dataclasses.replace(event.exit, rank=rank))
    return dataclasses.replace(event, rank=rank)


def lost_exit(rank: int, why: str, stopped: bool = False) -> failure.RankExit:
    """The exit record of a rank whose node or agent was lost: gone, and nobody saw how."""
    return failure.RankExit(rank, None, error=messages.Error("cell", LOST, why, "", time.time()), seen=time.time(),
                            stopped=stopped)
