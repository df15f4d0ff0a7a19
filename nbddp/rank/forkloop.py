"""The forkserver: a process that never initialised CUDA, which forks ranks for a kernel that may hold a
CUDA context (a fork of that kernel could not use a GPU).

It is either a fork of the kernel taken at ``%load_ext`` (before the kernel could touch CUDA: the
"template", with everything the kernel had imported by then), or a fresh interpreter started when it is
first needed (``python -m nbddp.rank.forkloop FD``). It serves one socket to the kernel, one request at
a time (kernel/ranks/forkserver.py is the other end; the messages are wire/forkmessages.py's, framed with
their descriptors by wire/fdframing.py):

- ``Prepare``: the kernel's ``sys.path``, working directory and environment at the cell, and the modules the
  kernel has imported that the server lacks, imported here so every rank forked later has them (a package
  whose import initialised CUDA here is reported and the server ends: kernel/ranks/forkserver.py starts a fresh
  one without it);
- ``SetJob``: the gang's job, pickled once;
- ``Fork``: one rank, with its spec, the job (pickled once per gang) and its descriptors (stdout, stderr,
  channel; store pipes, command pipe), passed with SCM_RIGHTS; answered with the rank's pid;
- anything else: ``Refused`` (the kernel raises it at once).

It reaps its ranks itself and tells the kernel each one's wait status and peak memory (``Reaped``), kills
a rank's process group before reaping it (the kernel's supervisor does the same for its own children), dies
with the kernel (PR_SET_PDEATHSIG) and ignores Jupyter's SIGINT; its ranks die with it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import os
import pickle
import selectors
import signal
import socket
import sys
import warnings

from ..wire import fdframing
from ..wire.forkmessages import Fork, Forked, JobSet, Prepare, Prepared, Reaped, Refused, SetJob
from . import worker
from .stdio import LIBC, POSIX

# never imported ahead in the server: the kernel's own machinery, debuggers, what may start compile workers
KERNEL_ONLY = ("__main__", "nbddp", "ipykernel", "debugpy", "pydevd", "_pydev", "_pydevd", "zmq", "jupyter_client",
               "tornado", "comm", "torch._inductor", "triton", "torch.compiler", "IPython.core.debugger")


# -- the server ---------------------------------------------------------------------------------------------------
class ForkLoop:
    def __init__(self, sock: socket.socket, kernel_pid: int):
        self.sock, self.kernel_pid = sock, kernel_pid
        self.job: bytes | None = None
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, None)
        try:
            with open(f"/proc/{kernel_pid}/comm", "rb") as f:
                self.kernel_name = f.read().strip()
        except OSError:
            self.kernel_name = b"python"

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    try:
                        request, fds = fdframing.receive(self.sock)
                    except fdframing.Unreadable as e:  # (read whole: the next request is read as it should be)
                        fdframing.send(self.sock, Refused(f"the forkserver cannot read the request: {e}"))
                        continue
                    except (EOFError, OSError):
                        return  # the kernel is gone (its ranks die with this process)
                    self.answer(request, fds)
                else:
                    self.reap(key.fd)

    def answer(self, request, fds: list[int]) -> None:
        """One reply to each request; the descriptors that came with it are closed once it is answered
        (a rank forked meanwhile holds its own copies)."""
        try:
            reply = self._reply(request, fds)
            pidfds = [fd for fd, pid in self.children.items() if pid == reply.pid] if isinstance(reply, Forked) else []
            fdframing.send(self.sock, reply, pidfds)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if isinstance(request, Prepare) and cuda_held():
            os._exit(3)  # reported in the reply: the kernel starts a fresh server

    def _reply(self, request, fds: list[int]):
        if isinstance(request, Prepare):
            return prepare(request.path, request.cwd, request.environ, request.modules)
        if isinstance(request, SetJob):
            self.job = request.blob
            return JobSet()
        if isinstance(request, Fork):
            try:
                return Forked(self.fork(request.spec, request.roles, fds))
            except Exception as e:  # noqa: BLE001 - reported to the kernel, which raises it
                return Refused(f"{type(e).__name__}: {e}")
        return Refused(f"the forkserver does not know the request {type(request).__name__}")

    def fork(self, spec, roles: tuple, fds: list[int]) -> int:
        """A rank: ``roles`` names each descriptor received (out, err, chan, store_req, store_rep, cmd)."""
        got = dict(zip(roles, fds))
        job = self.job
        LIBC.fflush(None)
        pid = POSIX.fork()
        if pid == 0:  # pragma: no cover - the rank
            _name(self.kernel_name)  # a rank is named as the kernel's ranks are, not as its server
            with contextlib.suppress(BaseException):
                self.sel.close()
            for fd in (self.sock.fileno(), *self.children):
                with contextlib.suppress(OSError):
                    os.close(fd)
            spec = dataclasses.replace(
                spec, parent_pid=os.getppid(),
                store_fds=(got["store_req"], got["store_rep"]) if "store_req" in got else spec.store_fds)

            def load_job():
                server = pickle.loads(job)
                if "cmd" in got:
                    server.cmd_pipes = {spec.rank: (got["cmd"], None)}
                return server

            worker.fork_main(spec, None, out_fd=got["out"], err_fd=got["err"], chan_fd=got["chan"], close_fds=[],
                             load_job=load_job)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.sel.register(pidfd, selectors.EVENT_READ, pid)
        return pid

    def reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # its own children (DataLoader workers) go with it; pid still reserved
        _, status, usage = os.wait4(pid, 0)
        fdframing.send(self.sock, Reaped(pid, status, usage.ru_maxrss * 1024))


NAME = b"nbddp-forksrv"  # the server's process name (ps, psutil's name(): at most 15 bytes)
PR_SET_NAME = 15


def _name(name: bytes) -> None:
    with contextlib.suppress(Exception):
        LIBC.prctl(PR_SET_NAME, name[:15], 0, 0, 0)


def prepare(path, cwd, environ, modules) -> Prepared:
    """The kernel's setting at the cell, and its imports: returns what could not be imported, and the
    package whose import initialised CUDA here, if one did."""
    sys.path[:] = path
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    failed, poisoned = [], None
    mapped = _driver_mapped()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for package, names in _by_package(modules):
            for name in names:
                if name in sys.modules:
                    continue
                try:
                    importlib.import_module(name)
                except BaseException:  # noqa: BLE001 - the rank imports it itself, if it can
                    failed.append(name)
            now = _driver_mapped()
            if now != mapped:  # the driver arrived with this package: did it initialise it too?
                mapped = now
                if cuda_held():
                    poisoned = package
                    break
    return Prepared(failed, poisoned)


def _by_package(modules):
    order: dict[str, list[str]] = {}
    for name in modules:
        if not name.startswith(KERNEL_ONLY):
            order.setdefault(name.partition(".")[0], []).append(name)
    return order.items()


def _driver_mapped():
    from ..hw import driverwatch

    return driverwatch.driver_mapped()


def cuda_held() -> bool:
    """This process holds a CUDA context (a fork of it could not use a GPU)."""
    from ..hw import cuda

    return cuda.held_here()


def main() -> None:
    """``python -m nbddp.rank.forkloop FD KERNEL_PID``: a fresh interpreter serving the socket ``FD``."""
    fd, kernel_pid = int(sys.argv[1]), int(sys.argv[2])
    run(socket.socket(fileno=fd), kernel_pid, fresh=True)


def run(sock: socket.socket, kernel_pid: int, *, fresh: bool) -> None:
    """The server's life, in the forked template or the fresh interpreter. Never returns."""
    try:
        worker.tie_to_parent(kernel_pid)  # dies with the kernel, ignores its SIGINT, a process group of its own
        _name(NAME)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        keep = sock.fileno()
        null = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(null, target)
        log = os.environ.get("NBDDP_FORKSERVER_LOG")  # its own troubles, where asked (tests, a bug report)
        if log:
            os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
        if not fresh:  # the template holds none of the kernel's descriptors (its sockets, its files)
            os.closerange(3, keep)
            os.closerange(keep + 1, _max_fd())
        else:
            os.close(null)
            worker.warm_start(outside_shell=True)
        gc.freeze()
        ForkLoop(sock, kernel_pid).serve()
    finally:
        os._exit(0)


def _max_fd() -> int:
    try:
        return max(int(n) for n in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


if __name__ == "__main__":
    main()
