"""The kernel's end of the forkserver (rank/forkloop.py): started, asked for ranks, told what the kernel
imported, and its ranks' exits read back.

Which server: a fork of the kernel taken at ``%load_ext`` (``at_load``), while the kernel holds no CUDA
context, where GPU ranks may be wanted (torch built with CUDA and NVML seeing a GPU; ``NBDDP_FORKSERVER``:
``template`` always, ``fresh`` or ``off`` never); otherwise, or once that one is gone, a fresh interpreter
started at the first cell that needs it. Either imports what the kernel has imported before it forks a
cell's ranks (``ForkServer.prepare``), so a rank's first step runs at fork speed, and takes the kernel's
``sys.path``, working directory and environment as they are at the cell. One request at a time, under a
lock (a background cell's thread and the notebook's may both start ranks); the exits its ranks report
arrive between the replies and are kept until the supervisor asks (``wait_exit``). The messages are
wire/forkmessages.py's, framed with their descriptors by wire/fdframing.py; a request the server refuses
is raised at once (``ForkServerRefused``).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from ...errors import UsageError
from ...rank import forkloop
from ...rank.stdio import POSIX
from ...wire import fdframing
from ...wire.forkmessages import Fork, Forked, Prepare, Prepared, Reaped, Refused, SetJob
from . import rendezvous


class ForkServer:
    def __init__(self, sock: socket.socket, pid: int, kind: str):
        self.sock, self.pid, self.kind = sock, pid, kind  # kind: "template" | "fresh"
        self.exits: dict[int, tuple[int, int]] = {}  # rank pid -> (wait status, peak RSS bytes)
        self.lock = threading.RLock()
        self.gone = False
        self.imported: set[str] = set()  # module names sent to it already

    # -- starting one -----------------------------------------------------------------------------------------
    @classmethod
    def template(cls) -> "ForkServer":
        """A fork of the kernel, now (its imports and settings as they are at ``%load_ext``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        kernel = os.getpid()
        pid = POSIX.fork()
        if pid == 0:  # pragma: no cover - the template; never returns
            ours.close()
            forkloop.run(theirs, kernel, fresh=False)
        theirs.close()
        return cls(ours, pid, "template")

    @classmethod
    def fresh(cls) -> "ForkServer":
        """A fresh interpreter (``python -m nbddp.rank.forkloop``), importing torch and nbddp's rank side."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = theirs.fileno()
        pid = POSIX.posix_spawn(sys.executable, [sys.executable, "-m", "nbddp.rank.forkloop", "3",
                                                          str(os.getpid())],
                                         rendezvous.interpreter_env(), file_actions=[(os.POSIX_SPAWN_DUP2, fd, 3)],
                                         setpgroup=0)
        theirs.close()
        return cls(ours, pid, "fresh")

    # -- requests ---------------------------------------------------------------------------------------------
    def request(self, message, fds=(), timeout: float | None = 60.0):
        """``message``'s reply; ForkServerRefused where the server refused it (the server goes on). Anything
        that leaves the exchange unfinished (the server gone, no answer in ``timeout``, an interrupt while
        waiting) ends the server: a later answer would be taken for another's."""
        with self.lock:
            if self.gone:
                raise ForkServerGone(self.kind)
            answered = False
            try:
                fdframing.send(self.sock, message, fds)
                reply = self._reply(timeout)
                answered = True
            except (OSError, EOFError):
                raise ForkServerGone(self.kind) from None
            finally:
                if not answered:  # the server gone, or an interrupt mid-exchange: the stream is out of step
                    self._lost()
        if isinstance(reply, Refused):
            raise ForkServerRefused(reply.error)
        return reply

    def _reply(self, timeout):
        """The answer to the request just sent (the ranks' exits met on the way are kept)."""
        while isinstance(message := self._next(timeout), Reaped):
            pass
        return message

    def _next(self, timeout):
        self.sock.settimeout(timeout)
        try:
            message, fds = fdframing.receive(self.sock)
        finally:
            self.sock.settimeout(None)
        if isinstance(message, Forked) and fds:
            message.pidfd, fds = fds[0], fds[1:]
            os.set_inheritable(message.pidfd, False)  # (received inheritable: no child of the kernel may hold it)
        for fd in fds:  # (none comes with another answer)
            os.close(fd)
        if isinstance(message, Reaped):
            self.exits[message.pid] = (message.status, message.peak_rss)
        return message

    def prepare(self, never: set[str]) -> Prepared:
        """The kernel's sys.path, working directory, environment and imports, given to the server; returns
        its answer (``poisoned``: a package whose import initialised CUDA there, which ended it)."""
        modules = [n for n in list(sys.modules) if n not in self.imported and n.partition(".")[0] not in never]
        answer = self.request(Prepare(list(sys.path), os.getcwd(), dict(os.environ), modules), timeout=None)
        self.imported.update(modules)
        if answer.poisoned:
            self._lost()
        return answer

    def set_job(self, blob: bytes) -> None:
        self.request(SetJob(blob))

    def fork(self, spec, roles: tuple, fds: list[int]) -> Forked:
        """The rank's pid and its pidfd (the caller's to close)."""
        try:
            return self.request(Fork(spec, tuple(roles)), fds)
        except ForkServerRefused as e:
            raise RuntimeError(f"the forkserver could not start rank {spec.rank}: {e}") from None

    def wait_exit(self, pid: int) -> tuple[int, int]:
        """A rank's wait status and peak RSS, once the server has reaped it (its pidfd said it ended)."""
        with self.lock:
            while pid not in self.exits and not self.gone:
                try:
                    self._next(timeout=30.0)
                except (OSError, EOFError):
                    self._lost()
            return self.exits.pop(pid, (signal.SIGKILL, 0))  # the server died first: its ranks were killed with it

    # -- its end ----------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        if self.gone:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            self._lost()
        return not self.gone

    def _lost(self) -> None:
        self.gone = True
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)  # (SIGKILL: at once; reaped, no zombie is left in the kernel)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.sock.close()


class ForkServerGone(RuntimeError):
    def __init__(self, kind):
        super().__init__(f"nbddp's forkserver ({kind}) has ended; the next cell starts a new one")


class ForkServerRefused(RuntimeError):
    """The server answered a request with an error (it goes on serving)."""


class Current:
    """The kernel's forkserver, one at a time, and what the servers learned never to import ahead."""

    def __init__(self):
        self.server: ForkServer | None = None
        self.never: set[str] = set()  # packages that initialised CUDA in a server: never imported ahead again


CURRENT = Current()


def policy() -> str:
    """``template``, ``fresh`` or ``off``: what ``%load_ext`` starts (NBDDP_FORKSERVER, else by the machine)."""
    asked = os.environ.get("NBDDP_FORKSERVER", "").strip().lower()
    if asked in ("template", "fresh", "off"):
        return asked
    from ...hw import cuda, nvml

    try:
        return "template" if cuda.backend().built() and nvml.backend().count() > 0 else "off"
    except Exception:  # noqa: BLE001 - no NVML: no GPU ranks to start from a kernel holding CUDA
        return "off"


def at_load() -> None:
    """``%load_ext``: the template, while the kernel holds no CUDA context, where GPU ranks may be wanted."""
    if CURRENT.server is not None and CURRENT.server.alive or policy() != "template":
        return
    from ...hw import cuda, openmp
    from ...rank import inherit

    if cuda.backend().refusal() is not None:
        return  # too late for a clean template: a fresh interpreter at the first cell that needs one
    try:
        openmp.release_threads(2)  # no OpenMP pool for the template's ranks to wait on, whatever their --threads
    except UsageError:
        return
    inherit.before_fork()
    CURRENT.server = ForkServer.template()


def get() -> ForkServer:
    """The running server, or a fresh one."""
    if CURRENT.server is None or not CURRENT.server.alive:
        CURRENT.server = ForkServer.fresh()
    return CURRENT.server


def ready(never: set[str]) -> ForkServer:
    """A server that has the kernel's imports and settings of now (but ``never``'s packages); a package
    that initialised CUDA in it ends it, and a fresh one is made without it."""
    for _ in range(3):
        server = get()
        poisoned = server.prepare(never | CURRENT.never).poisoned
        if not poisoned:
            return server
        CURRENT.never.add(poisoned)
    raise RuntimeError("nbddp's forkserver keeps initialising CUDA as it imports the kernel's modules "
                       f"({', '.join(sorted(CURRENT.never))}); use --start-method spawn")
