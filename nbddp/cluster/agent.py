"""On each other node of a cluster pool, inside a Ray actor: forks the node's ranks and streams their events.

One ``Agent`` per node (placement.py puts it in the node's bundle of the pool's placement group). It
never initialises CUDA: it forks its ranks with nbddp's own starter (pipes, typed channel, parent-death
signal, 0700 run directory, 0600 logs on this node) and supervises them with nbddp's own supervisor, on
one thread of its own (it forks and lives as long as its ranks: a parent-death signal follows the thread
that forked). Whatever the supervisor publishes (output, records, exits) and every store request of its
ranks goes into one ordered queue, which the kernel reads through ``events``, a streaming actor method,
in batches (as many as have accumulated while the last batch travelled).

The kernel's calls (``control``: a command for the ranks' command pipes, a signal, a store reply, stop)
carry a sequence number and are applied in that order, whatever order Ray's threads deliver them in: at
once on the calling thread (a pipe write or a signal), a stop on the supervisor's thread.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading

from ..kernel import rendezvous
from ..kernel.logs import RankLogs
from ..kernel.starters import ForkStarter
from ..kernel.supervisor import Bus, Supervisor
from ..rank.pipestore import Frames, write_all
from ..rank.server import Server


class Agent:
    def __init__(self, node_rank: int):
        self.node_rank = node_rank
        self.queue: list = []  # events not yet streamed to the kernel
        self.cond = threading.Condition()
        self.finished = False
        self.controls: dict[int, tuple] = {}  # seq -> (op, args): applied in sequence order
        self.applied = 0
        self.order = threading.Lock()
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        self.sup: Supervisor | None = None
        self.cmd: dict[int, int] = {}  # rank -> its command pipe's write end
        self.replies: dict[int, int] = {}  # rank -> its store reply pipe's write end
        self.requests: dict[int, tuple[int, Frames]] = {}  # request fd -> (rank, frames)
        self.pids: dict[int, int] = {}
        self.error: BaseException | None = None

    def where(self) -> dict:
        """This node as the kernel names it."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "host": socket.gethostname(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    # -- start ---------------------------------------------------------------------------------------------
    def start(self, specs: list, ifname: str | None) -> dict[int, int]:
        """Fork the node's ranks (``specs``: worker.RankSpec each, the kernel's view of them); returns
        rank -> pid once every rank is forked."""
        if not ifname:  # the interface that carries this node's Ray address
            from .placement import ifname_for

            ifname = ifname_for(self.where()["ip"])
        started = threading.Event()
        thread = threading.Thread(target=self._life, args=(specs, ifname, started), name="nbddp-agent", daemon=True)
        thread.start()
        started.wait()
        if self.error is not None:
            raise self.error
        return dict(self.pids)

    def _life(self, specs, ifname, started) -> None:
        try:
            run_dir = rendezvous.new_run_dir()
            logs = RankLogs({s.rank: str(run_dir.log(s.rank)) for s in specs})
            self.sup = sup = Supervisor(Bus([logs, self]))
            sup.watch(self.wake_r, self._wake)
            starter = ForkStarter(run_dir)
            for spec in specs:
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
                proc = starter.start(spec, Server(cmd_pipes={spec.rank: (cmd_r, cmd_w)}), inherited)
                for fd in (cmd_r, req_w, rep_r):
                    os.close(fd)
                sup.add(proc)
                self.pids[spec.rank] = proc.pid
                self.cmd[spec.rank] = cmd_w
                self.replies[spec.rank] = rep_w
                self.requests[req_r] = (spec.rank, Frames())
                sup.watch(req_r, lambda fd=req_r: self._store_request(fd))
        except BaseException as e:  # noqa: BLE001 - the kernel's start() raises it
            self.error = e
            started.set()
            self._finish()
            return
        started.set()
        try:
            sup.wait(None)
        finally:
            sup.close()
            logs.close()
            run_dir.release_store()
            for fd in (*self.cmd.values(), *self.replies.values(), *self.requests):
                _close(fd)
            self._finish()

    def _finish(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    # -- the supervisor's events, queued for the kernel ---------------------------------------------------------
    def _push(self, item) -> None:
        with self.cond:
            self.queue.append(item)
            self.cond.notify_all()

    def on_Output(self, event) -> None:
        self._push(event)

    def on_OutputClosed(self, event) -> None:
        self._push(event)

    def on_Message(self, event) -> None:
        self._push(event)

    def on_Exited(self, event) -> None:
        self._push(event)

    def _store_request(self, fd: int) -> None:
        rank, frames = self.requests[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.sup.sel.unregister(fd)
            return
        for request in frames.feed(data):
            self._push(("store", rank, request))

    def events(self):
        """The stream the kernel reads: lists of events, in order, until every rank has exited."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.finished)
                batch, self.queue = self.queue, []
                done = self.finished and not batch
            if done:
                return
            yield batch

    # -- the kernel's calls, in their order ------------------------------------------------------------------------
    def control(self, seq: int, op: str, *args) -> None:
        """Applied here, in sequence order (a call that arrives early waits in ``controls`` for the ones
        before it); a stop goes through the supervisor's thread, which owns the escalation clock."""
        with self.order:
            self.controls[seq] = (op, args)
            while (item := self.controls.pop(self.applied + 1, None)) is not None:
                self.applied += 1
                op, args = item
                if op == "stop":
                    self.stopping = True
                    os.write(self.wake_w, b"x")
                else:
                    getattr(self, "_" + op)(*args)

    def _wake(self) -> None:
        """On the supervisor's thread: a stop the kernel asked for."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        if self.stopping:
            self.stopping = False
            self.sup.stop_all()

    def _command(self, frame: bytes, ranks) -> None:
        for rank in ranks:
            fd = self.cmd.get(rank)
            if fd is None:
                continue
            try:
                write_all(fd, frame)
            except OSError:
                pass  # that rank is gone; its exit says how

    def _store_reply(self, rank: int, frame: bytes) -> None:
        fd = self.replies.get(rank)
        if fd is not None:
            try:
                write_all(fd, frame)
            except OSError:
                pass

    def _signal(self, rank: int, sig: int, group: bool) -> None:
        for p in self.sup.live():
            if p.rank == rank:
                if sig in (signal.SIGTERM, signal.SIGKILL):
                    p.stop_sent = True  # its exit record says nbddp stopped it
                p.signal(sig, group)



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
