"""In the kernel: the ranks on other nodes, as the supervisor sees them, fed by their agents' event streams.

Each agent's ``events`` stream is read by a thread of its own (``Streams``), and a cell's command comes
back with its ranks' answers when they are quick (agent.py): the batches of both are numbered and
published in that order. Store requests are answered at once (relaystore.Store: the ranks' rendezvous never waits for the kernel's main thread), every
other event is queued and a byte written to a wake pipe the supervisor watches (``Supervisor.watch``), so
the main thread's one loop publishes them on the same bus as local ranks' events, in each rank's order:
the relay, the logs, the dashboard and the failure rules cannot tell the two apart. A stream that ends
before its ranks have (the agent's actor died, its node was lost) ends those ranks with a record naming
the node.

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

from ..kernel import failure
from ..kernel.supervisor import STACK_QUIET_S, Exited, Message, Output, RankProc
from ..wire import messages

LOST = "NodeLost"


@dataclasses.dataclass
class RemoteProc(RankProc):
    """A rank on another node: no pipes here; its agent signals it."""

    link: object = None  # the node's Link

    def signal(self, sig: int, group: bool = True) -> None:
        self.link.control("signal", self.rank, int(sig), group)


class Link:
    """The kernel's end of one agent for one pool: its calls in order (a sequence number each), and the
    order of the batches of events it sends back (numbered: the stream's and the calls' answers)."""

    def __init__(self, actor, node: str, ranks: list[int], pool: str = ""):
        self.actor, self.node, self.ranks, self.pool = actor, node, ranks, pool
        self.seq = 0
        self.lock = threading.Lock()
        self.lost: str | None = None
        self.on_answer = None  # Streams: a call's answer, a numbered batch, put in its place
        self.next = 0  # the number of the next batch to publish
        self.held: dict[int, list] = {}  # batches come before their turn
        self.end: int | None = None  # batches the stream said it sent in all (its last item)
        self.finished = False  # the stream's end published
        self.clean = False  # ... after every batch, its ranks all exited: the agent can serve another pool
        self.pending: dict[int, object] = {}  # seq -> the ref of a call whose answer may still come
        self.answered: collections.deque = collections.deque()  # seqs answered: their refs can go

    def control(self, op: str, *args, answer: bool = False) -> None:
        """``answer``: a cell's command, whose call brings back its ranks' answers (see agent.Agent.control)."""
        if self.lost:
            return
        with self.lock:
            self.seq += 1
            call = pickle.dumps((self.pool, self.seq, op, args, answer), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                ref = self.actor.control.remote(call)  # one argument: Ray serialises each one separately
            except Exception:  # noqa: BLE001 - the agent is gone: its stream's end says so
                return
        if answer and self.on_answer is not None:
            while self.answered:  # (dropped here, not on Ray's thread that ran the callback)
                self.pending.pop(self.answered.popleft(), None)
            self.pending[seq := self.seq] = ref  # kept until answered: Ray fetches a large answer only while
            # its ref lives (a ref dropped meanwhile aborts the kernel: "ObjectUnknownOwner")
            on_answer = self.on_answer

            def answered(got):
                self.answered.append(seq)
                on_answer(self, got)

            _when_done(ref, answered)


def _when_done(ref, callback) -> None:
    """``callback(value or exception)`` on Ray's I/O thread once ``ref`` is ready. ObjectRef._on_completed is
    what Ray's own asyncio support uses; ``future()`` (public) costs ~0.2 ms more per call here."""
    try:
        ref._on_completed(callback)
    except AttributeError:
        ref.future().add_done_callback(lambda f: callback(f.exception() or f.result()))


class Streams:
    """Every agent's event stream, read by one thread each, delivered on the kernel's main thread."""

    def __init__(self, sup, store):
        self.sup, self.store = sup, store
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: collections.deque = collections.deque()  # taken from ``events``, not yet published
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)  # a full pipe is a wake already due: a reader never blocks on it
        self.threads: list[threading.Thread] = []
        self.links: list[Link] = []
        self.replies: queue.SimpleQueue = queue.SimpleQueue()  # store requests that came with a call's answer
        self.replier: threading.Thread | None = None  # ... answered on a thread of nbddp's (started when needed)
        self.procs: dict[int, RemoteProc] = {}
        self.order = threading.Lock()  # batches published one at a time, each agent's in its order
        sup.watch(self.wake_r, self.deliver)

    def follow(self, link: Link, gen) -> None:
        """Read ``gen``, the agent's ``events`` stream (past its first item), on a thread of its own; the
        answers of ``link``'s calls join it in order."""
        link.on_answer = self._answer
        self.links.append(link)
        t = threading.Thread(target=self._read, args=(link, gen), name=f"nbddp-node-{link.node}", daemon=True)
        self.threads.append(t)
        t.start()

    def _read(self, link: Link, gen) -> None:
        import ray

        why = end = None
        try:
            for ref in gen:
                n, batch = pickle.loads(ray.get(ref))
                if n == "end":
                    end = batch
                else:
                    self._batch(link, n, batch)
        except Exception as e:  # noqa: BLE001 - the actor died, or its node went away
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self._ended(link, end, why)

    def _answer(self, link: Link, got) -> None:
        """On Ray's own thread (the kernel's Ray I/O: nothing here may call Ray): a cell's command's call
        came back, with its ranks' answers or without."""
        if isinstance(got, bytes):
            n, batch = pickle.loads(got)
            self._batch(link, n, batch)

    def _store_handle(self, link: Link, rank: int, request) -> None:
        """A store request answered: at once on a stream's reader; from Ray's thread, through ``replier``
        (its reply is a Ray call, and a Ray call from Ray's I/O thread could wait for that thread)."""
        if threading.current_thread() in self.threads:
            self.store.handle(request, lambda frame: link.control("store_reply", rank, frame))
            return
        if self.replier is None:
            self.replier = threading.Thread(target=self._reply_loop, name="nbddp-store-replies", daemon=True)
            self.replier.start()
        self.replies.put((link, rank, request))

    def _reply_loop(self) -> None:
        while (item := self.replies.get()) is not None:
            link, rank, request = item
            self.store.handle(request, lambda frame, r=rank, lk=link: lk.control("store_reply", r, frame))

    def _batch(self, link: Link, n: int, batch: list) -> None:
        """Batch ``n`` of ``link``'s agent, from its stream or a call: published once the ones before it are."""
        stores: list = []
        with self.order:
            if link.finished:
                return
            link.held[n] = batch
            while link.next in link.held:
                self._sort(link, link.held.pop(link.next), stores)
                link.next += 1
            if link.end is not None and link.next >= link.end:
                self._finish(link, None)
        for _, rank, request in stores:  # (not under ``order``: answering is a Ray call)
            self._store_handle(link, rank, request)

    def _ended(self, link: Link, end: int | None, why: str | None) -> None:
        """The stream is over: after batch ``end`` - 1 (its last item), or at once (``why``: it broke off)."""
        with self.order:
            if link.finished:
                return
            if end is not None and not why:
                link.end = end
                if link.next < end:
                    return  # a call's answer still on its way: the last batch ends it
            else:
                for n in sorted(link.held):  # whatever came, in order (its store requests: no one to answer)
                    self._sort(link, link.held.pop(n), [])
            self._finish(link, why)

    def _finish(self, link: Link, why: str | None) -> None:
        link.clean = link.clean or (why is None and link.end is not None)
        link.finished = True
        link.lost = link.lost or why or "its agent's stream ended"
        self.events.put([("ended", link, why)])
        self._wake()

    def _sort(self, link: Link, batch: list, stores: list) -> None:
        """Store requests into ``stores`` (answered at once, by the caller); the rest for the main thread
        (under ``order``)."""
        rest = []
        for item in batch:
            if type(item) is tuple and item[0] == "store":
                stores.append(item)
            elif type(item) is tuple and item[0] == "error":  # the agent failed a call: the node is lost
                link.lost = item[1]
                rest.append(("ended", link, item[1]))
            else:
                rest.append(item)
        if rest:
            self.events.put(rest)
            self._wake()

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

    def _apply(self, event) -> None:
        sup = self.sup
        if type(event) is tuple:  # an agent's stream ended: its ranks still alive are lost with it
            _, link, why = event
            for rank in link.ranks:
                proc = self.procs[rank]
                if proc.exit is None:
                    self._exited(proc, lost_exit(rank, f"node {link.node} lost (ranks {', '.join(map(str, link.ranks))})"
                                                 + (f": {why}" if why else ""), stopped=proc.stop_sent))
            return
        proc = self.procs.get(event.rank)
        if proc is None or proc.exit is not None:
            return
        if isinstance(event, Output) and event.stream == "stderr" and sup._stacks_until is not None:
            sup._stacks_until = time.monotonic() + STACK_QUIET_S  # a stack dump still arriving
        if isinstance(event, Message):
            proc.records[type(event.record)] = event.record
        if isinstance(event, Exited):
            self._exited(proc, event.exit)
            return
        sup.bus.publish(event)

    def _exited(self, proc: RemoteProc, exit_: failure.RankExit) -> None:
        sup = self.sup
        sup._seen += 1
        proc.exit = dataclasses.replace(exit_, order=sup._seen, node=proc.node)
        sup.bus.publish(Exited(proc.rank, proc.exit))
        if failure.failed(proc.exit) and not proc.stop_sent:
            sup.stop_all()

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
        if self.replier is not None:
            self.replies.put(None)
            self.replier.join(within)
        if self.wake_w < 0 or not self.join(within):
            return
        with self.order:  # a call's answer coming after this is dropped
            for link in self.links:
                link.finished = True
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.wake_r = self.wake_w = -1


def lost_exit(rank: int, why: str, stopped: bool = False) -> failure.RankExit:
    """The exit record of a rank whose node or agent was lost: gone, and nobody saw how."""
    return failure.RankExit(rank, None, error=messages.Error("cell", LOST, why, "", time.time()), seen=time.time(),
                            stopped=stopped)
