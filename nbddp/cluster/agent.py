"""On each other node of a cluster pool, inside a Ray actor: forks the node's ranks and streams their events.

One ``Agent`` per node (placement.py puts it in the node's bundle of the pool's placement group). It
never initialises CUDA: ``events``, a streaming actor method, forks its ranks with nbddp's own starter
(pipes, typed channel, parent-death signal, 0700 run directory, 0600 logs on this node; from a thread of
its own that lives as long as they do, since a parent-death signal follows the thread that forked) and
supervises them with nbddp's own supervisor on the stream's thread. Whatever the supervisor publishes (output,
records, exits) and every store request of its ranks is yielded to the kernel in order, in batches (as many as
accumulated while the last batch travelled); an empty one each ``BEAT_S`` the stream had nothing else to say,
the beat by which the kernel knows the node is there (remote.Streams).

The kernel's calls (``control``; the messages of both ways are wire/agentmessages.py's: a command for the ranks'
command pipes, a store reply (addressed to the pid of the process that asked: a renumbering meanwhile cannot send
it to another), a signal, a look at the ranks, a renumbering, a rank forked again, the pool's finish) carry a
sequence number and are applied in that order, whatever order Ray's threads deliver them in, each by its handler
in ``HANDLERS`` (one the agent does not know is refused by its type's name, on the stream): a pipe write at once
on the calling thread; a signal on the supervisor's thread (woken through a pipe), the one that reaps, so a rank
already reaped (its pid maybe reused) is never signalled. A pipe to a rank that ended is closed by the next call,
never under a write of one (``_retire``).

An agent outlives its pool when the kernel keeps it (CPU pools, placement.agents): ``events`` begins each
pool afresh, and a call of a pool it no longer serves is ignored.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import socket
import threading
import time

from .. import timeline
from ..kernel import options
from ..kernel.ranks import rendezvous, warm
from ..kernel.ranks.logs import RankLogs
from ..kernel.ranks.membership import move_procs
from ..kernel.ranks.starters import ForkStarter
from ..kernel.ranks.supervisor import Supervisor
from ..rank.server import Server
from ..wire import agentmessages
from ..wire.framing import Reader, write_all
from .netif import ifname_for

RENUMBER_S = 10.0  # the supervisor's thread renumbers the node's ranks within this (it is idle: at once)


class Agent:
    def __init__(self):
        from ..rank.worker import warm_start

        warm_start(outside_shell=True)  # what ranks import (torch...), once here while the kernel forks its own:
        # shared by the forks, the IPython shell they make for displays included
        warm.start()  # what a real first step imports lazily, on a thread: each fork waits for it (_fork)
        self.order = threading.Lock()  # the kernel's calls, applied one at a time in sequence order
        # the kernel's calls the supervisor's thread applies, in their order (a signal sent before a renumbering
        # goes to the rank it was meant for): (a Signal, LookAtRanks or Renumber message, an event set once it's done)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.forked: queue.SimpleQueue = queue.SimpleQueue()  # a new rank forked meanwhile, for the supervisor's thread
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)  # a full pipe is a wake already due: control() never blocks on it
        self.retired: list[int] = []  # pipes to ranks that ended, closed by control() (see _retire)
        self._reset(None)

    def _reset(self, pool) -> None:
        """A pool's state, afresh (``pool``: the kernel's id for it, carried by each of its calls)."""
        self.pool = pool
        self.queue: list = []  # events not yet streamed to the kernel
        self.controls: dict[int, object] = {}  # seq -> the kernel's call (agentmessages): applied in sequence order
        self.applied = 0
        self.sup: Supervisor | None = None
        self.cmd: dict[int, int] = {}  # rank -> its command pipe's write end
        # a store reply goes to the process that asked (its pid), whatever number it answers to by then
        self.replies: dict[int, int] = {}  # pid -> its store reply pipe's write end
        self.requests: dict[int, tuple[int, Reader]] = {}  # request fd -> (the asking rank's pid, its frames)
        self.to_fork: queue.SimpleQueue = queue.SimpleQueue()  # specs of new ranks, for this pool's forker thread
        self.waiting = False  # a rank was lost: the stream stays open for its replacement until ``finish``
        self.logs: RankLogs | None = None
        self.run_dir = None
        for q in (self.calls, self.forked):
            while not q.empty():
                q.get_nowait()

    def where(self) -> dict:
        """This node as the kernel names it, and the interface that carries its Ray address (None: none does)."""
        import ray

        ctx, ip = ray.get_runtime_context(), ray.util.get_node_ip_address()
        return {"node_id": ctx.get_node_id(), "host": socket.gethostname(), "ip": ip, "pid": os.getpid(),
                "ifname": ifname_for(ip)}

    # -- the node's ranks, their life on this one thread -----------------------------------------------------------
    def events(self, pool: str, specs: list, ifname: str | None):
        """The stream the kernel reads for pool ``pool``: forks the node's ranks (``specs``: a worker.RankSpec
        each) and supervises them on this thread until every one has exited; yields rank -> pid first, then
        lists of events, each pickled, in order."""
        with self.order:
            _close_retired(self)  # (what the last pool's end could not close)
            self._reset(pool)
            to_fork = self.to_fork
        self.run_dir = run_dir = rendezvous.new_run_dir()
        self.logs = logs = RankLogs(run_dir, [s.rank for s in specs])
        self.sup = sup = Supervisor([logs, self])
        sup.on_loss = options.KERNEL_DECIDES  # a lost rank's fate, and its peers', is the kernel's to decide
        try:
            sup.watch(self.wake_r, self._wake)
            ifname = ifname or self.where()["ifname"]  # (none: the kernel refuses the pool)
            yield pickle.dumps(self._fork_all(specs, run_dir, ifname, to_fork))
            while sup.live() or self.queue or self.waiting:
                beat_at = time.monotonic() + timeline.BEAT_S
                if sup.live():
                    sup.wait(None, until=lambda at=beat_at: bool(self.queue) or time.monotonic() >= at,
                             wake_at=beat_at)
                else:  # a rank lost, none left here: the kernel may ask for its replacement (or say ``finish``)
                    sup.poll(timeline.BEAT_S)
                batch, self.queue = self.queue, []
                # bytes: Ray's cheapest path; an empty batch, the beat the kernel hears this node live by
                yield pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            sup.stop_all()  # (the kernel let go of the stream: nothing of this pool may stay)
            sup.reap()
            sup.close()
            logs.close()
            run_dir.release_store()
            for fd in self.requests:
                _close(fd)
            _retire(self, [*self.cmd.values(), *self.replies.values()])
            if self.order.acquire(timeout=RENUMBER_S):  # (the ranks are reaped: a write under way fails at once)
                try:  # (else a call holds it, waiting for this thread: closed by the next call, or pool)
                    _close_retired(self)
                finally:
                    self.order.release()
            to_fork.put(None)  # the forker thread ends

    def _fork_all(self, specs, run_dir, ifname, to_fork: queue.SimpleQueue) -> dict[int, int]:
        """rank -> pid, forked on a thread of nbddp's own that lives as long as the pool: a parent-death signal
        follows the thread that forked, and a rank's stack then starts at nbddp's frames, not Ray's. That thread
        forks the ranks the kernel asks for later (``fork_again``: a replacement for a lost one) from ``to_fork``
        until None, each handed to the supervisor's thread (``forked``)."""
        out: dict = {}
        forked = threading.Event()

        def forker():
            try:
                out["pids"] = {spec.rank: _register(self, _fork(spec, run_dir, ifname)) for spec in specs}
            except BaseException as e:  # noqa: BLE001 - raised on the stream's thread
                out["error"] = e
            forked.set()
            while (spec := to_fork.get()) is not None:
                try:
                    self.forked.put(_fork(spec, run_dir, ifname))
                except Exception as e:  # noqa: BLE001 - said to the kernel, the pool's other ranks live on
                    self.forked.put(e)
                self._poke()

        threading.Thread(target=forker, name="nbddp-agent-forker", daemon=True).start()
        forked.wait()
        if "error" in out:
            raise out["error"]
        return out["pids"]

    # -- the supervisor's events, queued for the kernel (all on the stream's thread) --------------------------------
    def on_Output(self, event) -> None:
        self.queue.append(event)

    def on_OutputClosed(self, event) -> None:
        self.queue.append(event)

    def on_Message(self, event) -> None:
        self.queue.append(event)

    def on_Exited(self, event) -> None:
        exit = event.exit
        if not (exit.stopped or exit.only_leaving or exit.ok):
            self.waiting = True
        self.queue.append(event)

    def _store_request(self, fd: int) -> None:
        pid, frames = self.requests[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.sup.unwatch(fd)
            return
        for request, _ in frames.feed(data):
            self.queue.append(agentmessages.StoreRequest(pid, request))

    # -- the kernel's calls, in their order ------------------------------------------------------------------------
    def control(self, call: bytes) -> None:
        """``call``: a pickled agentmessages.AgentCall, one argument (Ray serialises each one separately).
        Applied in sequence order (a call that arrives early waits in ``controls`` for the ones before
        it) by its handler in ``HANDLERS``: here, or for a signal, handed to the supervisor's thread. A call
        of a type it has no handler for is refused by that type's name, on the stream."""
        sent = pickle.loads(call)
        with self.order:
            _close_retired(self)
            if sent.pool != self.pool:
                return  # a call of a pool this agent serves no longer
            self.controls[sent.seq] = sent.call
            while (seq := self.applied + 1) in self.controls:
                self.applied = seq
                message = self.controls.pop(seq)
                handler = HANDLERS.get(type(message))
                if handler is None:
                    self._cannot(type(message).__name__, "not a call it knows")
                    continue
                try:
                    handler(self, message)
                except Exception as e:  # noqa: BLE001 - nobody reads this call's result: the stream says it
                    self._failed(message.op, e)

    def _failed(self, name: str, e: BaseException) -> None:
        """A kernel's call (``name``: its type's) this agent could not apply: said on the stream (the kernel ends
        the node with it; left in a Ray reference nobody reads, it would leave a cell waiting for a command that
        never came)."""
        first = str(e).splitlines()[0] if str(e) else ""
        self._cannot(name, f"{type(e).__name__}: {first}")

    def _cannot(self, name: str, why: str) -> None:
        self.queue.append(agentmessages.CallFailed(f"its agent could not apply the kernel's {name!r}: {why}"))
        self._poke()  # the supervisor's thread wakes and streams it

    def _poke(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:  # BlockingIOError: full, a wake is due anyway
            pass

    def _wake(self) -> None:
        """On the supervisor's thread: a rank forked anew, supervised and said to the kernel; then the kernel's
        calls in their order: its signals to the ranks not reaped yet, its renumberings, its looks (``_call``)."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while not self.forked.empty():
            new = self.forked.get_nowait()
            if isinstance(new, BaseException):
                self._failed(agentmessages.ForkAgain.op, new)
            else:
                self.queue.append(agentmessages.RankForked(new.spec.rank, _register(self, new)))
        while True:  # (no lock shared with control(): it may block on a full command pipe)
            try:
                call, done = self.calls.get_nowait()
            except queue.Empty:
                return
            _call(self, call, done)


# -- the handlers of the kernel's calls (``HANDLERS``), each given the agent and its message, under ``order`` ----------
def _command(agent: Agent, call: agentmessages.Command) -> None:
    frame = call.frame
    for rank in call.ranks:
        fd = agent.cmd.get(rank)
        if fd is None:
            continue
        try:
            write_all(fd, frame)
        except OSError:
            pass  # that rank is gone; its exit says how


def _store_reply(agent: Agent, call: agentmessages.StoreReply) -> None:
    fd = agent.replies.get(call.pid)
    if fd is not None:
        try:
            write_all(fd, call.frame)
        except OSError:
            pass


def _signal(agent: Agent, call: agentmessages.Signal) -> None:
    """For the supervisor's thread: this one may not see a rank's reaping."""
    agent.calls.put((call, None))
    agent._poke()


def _look(agent: Agent, call: agentmessages.LookAtRanks) -> None:
    """How each of its live ranks is, as /proc tells (kernel/cells/grace.py asks; ``call.ask``: the kernel's
    count for this node), streamed as ``Looked`` (rank -> procwait.Look)."""
    agent.calls.put((call, None))
    agent._poke()


def _renumber(agent: Agent, call: agentmessages.Renumber) -> None:
    """The kernel renumbered the pool (it shrank; ``call.moves``: this node's survivors, old rank -> new): done
    on the supervisor's thread (it reads these tables), and awaited here, so that the kernel's next call (a
    command for the new numbers) finds them."""
    done = threading.Event()
    agent.calls.put((call, done))
    agent._poke()
    if not done.wait(RENUMBER_S):
        raise TimeoutError(f"the node's supervisor did not renumber its ranks within {RENUMBER_S:g} s")


def _fork_again(agent: Agent, call: agentmessages.ForkAgain) -> None:
    """A new rank from ``call.spec`` (a lost one's replacement, joining the group's next generation), forked by
    the pool's forker thread; its pid streamed to the kernel as ``RankForked``."""
    agent.to_fork.put(call.spec)


def _finish(agent: Agent, call: agentmessages.Finish) -> None:
    """The kernel's pool is done with this node (it ended after a rank was lost here): once its ranks have
    exited, the stream ends."""
    agent.waiting = False
    agent._poke()


# each call of the kernel's (agentmessages.KERNEL_CALLS) -> its handler, called with the agent and the message
HANDLERS = {
    agentmessages.Command: _command,
    agentmessages.StoreReply: _store_reply,
    agentmessages.Signal: _signal,
    agentmessages.LookAtRanks: _look,
    agentmessages.Renumber: _renumber,
    agentmessages.ForkAgain: _fork_again,
    agentmessages.Finish: _finish,
}


@dataclasses.dataclass
class NodeRank:
    """A rank just forked, and the agent's ends of its pipes."""

    spec: object
    proc: object
    cmd_w: int
    rep_w: int
    req_r: int


def _fork(spec, run_dir, ifname) -> NodeRank:
    """One rank of the node, forked (``_register`` supervises it). A function, not a method: Ray wraps an actor
    class's methods, and a frame of its wrapper would sit under the rank's every stack."""
    warm.wait()  # its imports finished: no import lock held across the fork
    cmd_r, cmd_w = os.pipe()
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    env = dict(spec.env, TORCHELASTIC_ERROR_FILE=str(run_dir.path / f"rank{spec.rank}.error.json"))
    if ifname:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
        env.setdefault("NCCL_SOCKET_IFNAME", ifname)
    spec = dataclasses.replace(spec, parent_pid=os.getpid(), store_fds=(req_w, rep_r),
                               store_path=str(run_dir.store), env=env)
    keep = {0, 1, 2, cmd_r, cmd_w, req_w, rep_r}
    # the rank holds none of this process's descriptors (Ray's sockets among them)
    inherited = [fd for fd in _open_fds() if fd not in keep]
    try:
        proc = ForkStarter(run_dir).start(spec, Server(cmd_pipes={spec.rank: (cmd_r, cmd_w)}), inherited)
    except BaseException:
        for fd in (cmd_w, req_r, rep_w):
            os.close(fd)
        raise
    finally:
        for fd in (cmd_r, req_w, rep_r):
            os.close(fd)
    return NodeRank(spec, proc, cmd_w, rep_w, req_r)


def _call(agent: Agent, call, done: threading.Event | None) -> None:
    """On the supervisor's thread (it reaps, and reads the rank tables): one of the kernel's calls handed to it, a
    ``Renumber`` (``done`` set once applied), a ``LookAtRanks`` or a ``Signal``, in the kernel's order."""
    if isinstance(call, agentmessages.Renumber):
        _moved(agent, call.moves)
        agent.queue.append(agentmessages.Renumbered())  # what the stream says after this carries the new numbers
        done.set()
        return
    if isinstance(call, agentmessages.LookAtRanks):
        agent.queue.append(agentmessages.Looked(call.ask, {p.rank: p.look() for p in agent.sup.live()}))
        return
    try:
        for p in agent.sup.live():
            if p.rank == call.rank:
                if call.sig in (signal.SIGTERM, signal.SIGKILL):
                    p.stop_sent = True  # its exit record says nbddp stopped it
                p.signal(call.sig, call.group)
    except Exception as e:  # noqa: BLE001 - said to the kernel, the agent lives on
        agent._failed(agentmessages.Signal.op, e)


def _register(agent: Agent, new: NodeRank) -> int:
    """A rank just forked, supervised (on the supervisor's thread, or before its loop runs); its pid."""
    rank, pid = new.spec.rank, new.proc.pid
    if rank in agent.cmd:  # (a lost rank's, replaced)
        _retire(agent, [agent.cmd[rank]])
    agent.sup.add(new.proc)
    _forget_replies(agent)
    agent.cmd[rank] = new.cmd_w
    agent.replies[pid] = new.rep_w
    agent.requests[new.req_r] = (pid, Reader())
    agent.sup.watch(new.req_r, lambda fd=new.req_r: agent._store_request(fd))
    return new.proc.pid


def _moved(agent: Agent, moves: dict) -> None:
    """On the supervisor's thread: the node's ranks answer to their new numbers (the supervisor's records:
    ``membership.move_procs``, the kernel's Membership having decided; then, here, their command and store pipes,
    their logs); the ranks that ended are forgotten, their pipes closed."""
    move_procs(agent.sup, moves)
    gone = [fd for r, fd in agent.cmd.items() if r not in moves]
    agent.cmd = {moves[r]: fd for r, fd in agent.cmd.items() if r in moves}
    _retire(agent, gone)
    _forget_replies(agent)  # (the store's replies are addressed by pid: nothing to renumber)
    agent.logs.renumber(moves.values())


def _forget_replies(agent: Agent) -> None:
    """The store reply pipes of the ranks that ended, let go of (``_retire``: closed by the kernel's next call)."""
    live = {p.pid for p in agent.sup.procs if p.exit is None}
    _retire(agent, [agent.replies.pop(pid) for pid in [pid for pid in agent.replies if pid not in live]])


def _retire(agent: Agent, fds: list[int]) -> None:
    """Pipes to ranks that ended, let go of on the supervisor's thread: closed by the next of the kernel's calls
    (``control``, under ``order``), never here, where a Ray thread may be writing to one (a command, a store
    reply): closed under it, its number could be reused meanwhile by a new rank's pipe and the write reach that
    rank. (``order`` cannot be taken here: control() holds it while it waits for this thread to renumber.)"""
    agent.retired.extend(fds)


def _close_retired(agent: Agent) -> None:
    """Under ``order``: no write to a retired pipe is under way."""
    while agent.retired:
        _close(agent.retired.pop())


def _open_fds() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 256))


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
