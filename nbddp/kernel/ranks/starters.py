"""Starting ranks. One small class per start method (``ForkStarter``, ``SpawnStarter``,
``ForkserverStarter``; ``starter_for(plan)`` picks it), each starting a rank with three pipes (stdout,
stderr, its typed channel) and answering, before any rank exists, what its start method means to the rest
of the kernel (``Starter``: does a rank inherit the notebook, has it a command pipe, can the kernel's GPU
tensors reach it by CUDA IPC, what to advise when a global cannot be sent), so no caller compares
start-method names. ``rank_spec`` makes every rank's RankSpec (``rank_specs``: one per planned device;
``moved`` and ``again``: a pool's rank at a new place, or forked again); ``fork_specs`` starts one rank per
spec and registers each with the supervisor as soon as it exists, an interrupt held back meanwhile
(``sigint_deferred``); ``store_pipes`` ties forked ranks to the kernel's store; ``SWITCH_INTERVAL`` keeps the
kernel's own thread switch interval, which a rank starts with.
"""
from __future__ import annotations

import _signal
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import warnings

from ...hw import openmp
from ...rank import inherit
from ...rank.stdio import LIBC, POSIX
from ...rank.worker import RankSpec, fork_main, place_env
from ...wire import values
from .. import devices
from ..debugger import rankdebug
from . import rendezvous, warm
from .supervisor import RankProc, Supervisor

# Python 3.12+ warns on every fork of a multithreaded process, and a kernel always is one: nbddp's
# ranks only run the cell and exit through os._exit, and worker.py makes torch safe first.
warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning,
                        module=__name__)


def _life_pipe() -> tuple[int, int] | tuple[None, None]:
    """Where there are no pidfds (macOS): a pipe whose write end only the rank holds."""
    return (None, None) if hasattr(os, "pidfd_open") else os.pipe()


def rank_specs(config, plan: devices.Plan, run_dir) -> list[RankSpec]:
    """Each planned device's rank, as it is forked (a pool keeps them: a replacement for a lost rank is forked
    from its spec, with the same device and environment)."""
    ifname = rendezvous.loopback_ifname()
    port = rendezvous.free_port()
    return [rank_spec(plan, config, rank, _rank_env(plan, rank, run_dir.run_id, port, config.threads, ifname),
                      store_path=str(run_dir.store))
            for rank in range(plan.world_size)]


def moved(spec: RankSpec, rank: int, world_size: int) -> RankSpec:
    """``spec`` at a new place (a pool shrunk or grown): its rank, world size and the environment that says them."""
    return dataclasses.replace(spec, rank=rank, world_size=world_size, env={**spec.env, **place_env(rank, world_size)})


def again(spec: RankSpec, generation: int) -> RankSpec:
    """``spec`` for a replacement forked now, joining the group's generation ``generation``."""
    env = dict(spec.env, TORCHELASTIC_RESTART_COUNT=str(generation))
    return dataclasses.replace(spec, generation=generation, env=env, parent_pid=os.getpid(),
                               switch_interval=SWITCH_INTERVAL.kernels(), blocked=main_thread_blocked())


def rank_spec(plan: devices.Plan, config, rank: int, env: dict, store_path: str = "") -> RankSpec:
    """Rank ``rank``'s RankSpec, made here only (this machine's ranks, and a cluster pool's on every node):
    its place in the plan, the config's threads and seed, its environment ``env``, and the interpreter
    settings of the kernel's that it starts with whichever thread forks it. ``store_path``: the FileStore of
    a rank that has no store pipes ('' for a cluster pool's, which meet on the kernel's store)."""
    return RankSpec(rank=rank, world_size=plan.world_size, accelerator=plan.accelerator, backend=plan.backend,
                    device_id=plan.device_ids[rank], threads=config.threads, seed=config.seed,
                    store_path=store_path, parent_pid=os.getpid(), env=env,
                    switch_interval=SWITCH_INTERVAL.kernels(), blocked=main_thread_blocked())


def store_pipes(local, env=None, forked=None):
    """A ``prepare`` for fork_specs: each forked rank reaches the kernel's store over two pipes of its own
    (rank/pipestore.py), served by ``local`` (groupstore.LocalStores, a kernel thread), instead of a
    FileStore, whose waits poll every 10 ms: a rendezvous that answers as soon as the key is set. No rank
    inherits another's pipes. ``env(spec)``: the rank's environment, if it differs from the spec's;
    ``forked(proc)``: called with each forked rank."""
    def prepare(spec):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()

        def on_fork(proc):
            os.close(req_w)
            os.close(rep_r)
            local.add(req_r, rep_w)
            proc.store_fds = (req_r, rep_w)
            if forked is not None:
                forked(proc)

        spec = dataclasses.replace(spec, store_fds=(req_w, rep_r), env=env(spec) if env else spec.env)
        # the kernel's ends of the other ranks' store pipes, as they are now (a lost rank's are closed, their
        # numbers maybe this rank's own by now): no rank inherits them
        return spec, [*local.fds(), req_r, rep_w], on_fork

    return prepare


def fork_specs(sup: Supervisor, starter, job, specs, deadline: float | None = None, prepare=None) -> None:
    """One rank per spec, each registered with the supervisor as soon as it exists, an interrupt held
    back meanwhile. ``prepare(spec)``, if given: (the spec to fork, descriptors of the kernel's the rank
    must not inherit besides the supervisor's, a function given the forked RankProc before it is added)."""
    with sigint_deferred() as interrupted:  # a rank forked is registered before an interrupt is raised
        for spec in specs:  # nothing else between forks: rank 0 waits for the last one to rendezvous
            spec, not_inherited, forked = prepare(spec) if prepare else (spec, (), None)
            proc = starter.start(spec, job, [*sup.all_fds(), *not_inherited])
            try:
                rankdebug.rank_started(proc.pid, spec.rank)  # (the debugger panel names a rank's threads by it)
                if forked:
                    forked(proc)
            finally:  # (whatever failed after the fork: the child is the supervisor's, to be stopped with the rest)
                sup.add(proc)
            if interrupted or (deadline is not None and time.monotonic() >= deadline):
                break  # an interrupt is raised on leaving; the supervisor then finds the deadline passed


@contextlib.contextmanager
def sigint_deferred():
    """Hold an interrupt back while a rank is forked and registered; yields the (truthy once
    interrupted) list of interrupts noted, and raises at the end if the body did not.

    A signal mask would not do: Jupyter's SIGINT goes to the whole process, and any of the kernel's
    other threads takes it; so the handler itself is swapped for one that only takes note.
    """
    noted = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    # (the C module's own signal(): signal.signal's enum conversions cost ~9 us of a pool cell, this 0.7)
    previous = _signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield noted
    finally:
        _signal.signal(signal.SIGINT, previous)
        if noted:
            raise KeyboardInterrupt


class SwitchInterval:
    """The kernel's thread switch interval, in one home: a background cell lowers it while it runs
    (``lowered``, on its thread), and a rank starts with the kernel's own (``kernels``), whichever thread
    forks it. The lock keeps the setting and the note of the kernel's own one change: a rank forked as a
    background cell ends gets one or the other, never the lowered one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kernels: float | None = None  # the kernel's own, while lowered

    @contextlib.contextmanager
    def lowered(self, to: float):
        """At most ``to`` seconds for the block's length, the kernel's own setting back after it."""
        with self._lock:
            self._kernels = sys.getswitchinterval()
            sys.setswitchinterval(min(self._kernels, to))
        try:
            yield
        finally:
            with self._lock:
                sys.setswitchinterval(self._kernels)
                self._kernels = None

    def kernels(self) -> float:
        """The kernel's switch interval as the notebook set it (not a background cell's lowered one)."""
        with self._lock:
            return self._kernels if self._kernels is not None else sys.getswitchinterval()


SWITCH_INTERVAL = SwitchInterval()  # the kernel's


def main_thread_blocked() -> tuple:
    """The signals the kernel's main thread blocks, read whatever thread asks (Linux: its status in /proc)."""
    if threading.current_thread() is threading.main_thread():
        return tuple(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    try:
        with open(f"/proc/self/task/{os.getpid()}/status") as f:
            mask = int(next(ln for ln in f if ln.startswith("SigBlk:")).split()[1], 16)
    except (OSError, StopIteration, ValueError):
        return ()
    return tuple(signal.Signals(n) for n in range(1, signal.NSIG) if mask >> (n - 1) & 1 and n in _VALID)


_VALID = {s.value for s in signal.Signals}


def _rank_env(plan, rank, run_id, port, threads, ifname) -> dict:
    env = rendezvous.torchrun_env(
        rank=rank, world_size=plan.world_size, run_id=run_id, master_port=port, threads=threads, ifname=ifname
    )
    return nccl_env(env, plan.backend, ifname)


def nccl_env(env: dict, backend: str, ifname: str) -> dict:
    """``env`` with what an NCCL rank needs, its sockets on ``ifname`` (what ``env`` or the kernel's
    environment already says wins)."""
    if backend == "nccl":
        from ...hw import nccl
        from ...ipy.session import session_kind

        env.update({k: v for k, v in nccl.rank_env(ifname, session_kind()).items()
                    if k not in os.environ and k not in env})
    return env


# -- start methods ----------------------------------------------------------------------------------
class Starter:
    """A start method: how a gang's ranks come to be (``start``, after ``ready`` once per gang), and what
    that means to the rest of the kernel, asked of the class before any rank exists (the magic sends a
    one-shot cell's globals before its gang is made): each answer here, so that no caller compares names."""

    name = ""  # as --start-method says it (options.py's table; checks.preflight picks one for "auto")
    # the ranks are forks of the kernel taken as the cell starts: they hold the notebook's names as they
    # are (copy-on-write), so none is sent; otherwise the names a cell reads travel with it
    inherits_notebook = False
    # each rank reads commands on a pipe of its own (a pool's cells, a one-shot cell's Stop) and meets the
    # others on the kernel's store over pipes; spawned ranks get their job in a file, and a FileStore
    command_pipes = True
    # where a one-shot cell's global cannot be sent (pickled): what to do instead, after "create it inside
    # the cell"
    unsent_advice = "."

    def __init__(self, run_dir):
        self.run_dir = run_dir

    @classmethod
    def gpu_ipc(cls, plan: devices.Plan) -> bool:
        """The kernel's GPU tensors reach this plan's ranks by CUDA IPC (not as CPU copies)."""
        return False

    def ready(self, config) -> None:
        """Just before the gang's first rank starts."""

    def start(self, spec: RankSpec, job, inherited_fds: list[int]) -> RankProc:
        raise NotImplementedError

    def cleanup(self) -> None:
        """After the gang's ranks ended."""


class ForkStarter(Starter):
    """The default: a fork of the kernel, so notebook data is shared copy-on-write."""

    name = "fork"
    inherits_notebook = True

    def ready(self, config) -> None:
        """Just before the first fork of the kernel: the modules ranks would import lazily are in (warm.py's
        thread has finished: nothing of nbddp's runs during the fork), the kernel's idle OpenMP threads
        released (nothing runs a parallel op between this and the forks)."""
        warm.wait()
        openmp.release_threads(config.threads)

    def start(self, spec: RankSpec, job, inherited_fds: list[int]) -> RankProc:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        chan_r, chan_w = os.pipe()
        life_r, life_w = _life_pipe()
        LIBC.fflush(None)  # C-level buffers would otherwise be written again by the child
        inherit.before_fork()  # what the rank patches, found here: it would fault copying pages there
        pid = POSIX.fork()
        if pid == 0:  # pragma: no cover - the child; fork_main never returns (life_w stays open)
            fork_main(spec, job, out_fd=out_w, err_fd=err_w, chan_fd=chan_w,
                      close_fds=[*inherited_fds, out_r, err_r, chan_r, *([life_r] if life_r is not None else [])])
        return _parent_side(pid, spec.rank, out_r, err_r, chan_r, (out_w, err_w, chan_w), (life_r, life_w))


class SpawnStarter(Starter):
    """A fresh interpreter per rank: for platforms without fork, or a kernel that already uses CUDA."""

    name = "spawn"
    command_pipes = False
    unsent_advice = ", or use --start-method fork (it shares the notebook's objects)."

    def __init__(self, run_dir):
        super().__init__(run_dir)
        self.job_path = run_dir.path / "job.pkl"

    def start(self, spec: RankSpec, job, inherited_fds: list[int]) -> RankProc:
        if not self.job_path.exists():
            fd = os.open(self.job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(values.dumps(job))
        spec_path = self.run_dir.path / f"spec{spec.rank}.pkl"
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(values.dumps(spec))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        chan_r, chan_w = os.pipe()
        life_r, life_w = _life_pipe()
        env = rendezvous.interpreter_env()
        pid = POSIX.posix_spawn(
            sys.executable,
            [sys.executable, "-m", "nbddp.rank.spawn_main", str(spec_path), str(self.job_path)],
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
                (os.POSIX_SPAWN_DUP2, chan_w, 3),
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                *([(os.POSIX_SPAWN_DUP2, life_w, 4)] if life_w is not None else []),
            ],
            setpgroup=0,
        )
        return _parent_side(pid, spec.rank, out_r, err_r, chan_r, (out_w, err_w, chan_w), (life_r, life_w))

    def cleanup(self) -> None:
        for p in self.run_dir.path.glob("*.pkl"):
            p.unlink(missing_ok=True)


class ForkserverStarter(Starter):
    """Ranks forked by the forkserver (kernel/ranks/forkserver.py), a process that never initialised CUDA: for a
    kernel that holds a CUDA context and ranks that need GPUs (chosen by checks.preflight), or asked for by
    name. The notebook values a cell reads travel with it as with spawn, big tensors and arrays through
    shared memory (wire/sharedtensor.py), the kernel's GPU tensors to GPU ranks by CUDA IPC; its imports
    are the kernel's, done once in the server."""

    name = "forkserver"
    unsent_advice = ("; forkserver ranks are no forks of the kernel and cannot share its objects (where the "
                     "kernel holds no CUDA, --start-method fork shares them).")

    def __init__(self, run_dir):
        super().__init__(run_dir)
        self.server = None
        self._job = None  # the job the server holds (one per gang)

    @classmethod
    def gpu_ipc(cls, plan: devices.Plan) -> bool:
        return plan.accelerator == "cuda"

    def ready(self, config) -> None:
        """Before the first rank, outside the forks' deferred interrupt (the server's imports can take
        seconds the first time: an interrupt then ends the server, and the next cell starts a fresh one)."""
        from ...hw import cuda
        from . import forkserver

        self.server = forkserver.ready(cuda.backend().culprits())

    def start(self, spec: RankSpec, job, inherited_fds: list[int]) -> RankProc:
        if self.server is None:
            self.ready(None)
        pipes = getattr(job, "cmd_pipes", None) or {}
        if self._job is not job:
            self.server.set_job(values.to_ranks(_without_pipes(job)))
            self._job = job
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        chan_r, chan_w = os.pipe()
        roles, fds = ["out", "err", "chan"], [out_w, err_w, chan_w]
        if spec.store_fds is not None:
            roles += ["store_req", "store_rep"]
            fds += list(spec.store_fds)
        if spec.rank in pipes:
            roles.append("cmd")
            fds.append(pipes[spec.rank][0])
        done = False
        try:
            forked = self.server.fork(spec, tuple(roles), fds)
            done = True
        finally:
            if not done:  # whatever stopped the fork, an interrupt too
                for fd in (out_r, out_w, err_r, err_w, chan_r, chan_w):
                    os.close(fd)
        proc = _parent_side(forked.pid, spec.rank, out_r, err_r, chan_r, (out_w, err_w, chan_w), (None, None),
                            pidfd=forked.pidfd)
        server = self.server
        proc.reap = lambda: server.wait_exit(forked.pid)  # not the kernel's child: the server reaps it
        return proc


def _without_pipes(job):
    """The job as the server keeps it: no command pipes (each rank is given its own end)."""
    if not getattr(job, "cmd_pipes", None):
        return job
    import copy

    job = copy.copy(job)
    job.cmd_pipes = {}
    return job


STARTERS = {cls.name: cls for cls in (ForkStarter, SpawnStarter, ForkserverStarter)}


def starter_for(plan: devices.Plan) -> type[Starter]:
    """The start method the plan's ranks start by (its class: ask it what that means, or make the gang's)."""
    return STARTERS[plan.start_method]


def _parent_side(pid, rank, out_r, err_r, chan_r, child_ends, life, pidfd: int = -1) -> RankProc:
    """The kernel's side of a rank just started: ``pidfd``, one opened where it was forked (the forkserver's:
    not the kernel's child, its number free once the server reaped it), else opened here."""
    life_r, life_w = life
    for fd in (*child_ends, *([life_w] if life_w is not None else [])):
        os.close(fd)
    try:
        os.setpgid(pid, pid)  # also done in the child; whichever runs first wins the race
    except OSError:
        pass
    exit_fd = life_r if life_r is not None else pidfd if pidfd >= 0 else os.pidfd_open(pid)
    return RankProc(rank, pid, exit_fd, {out_r: "stdout", err_r: "stderr", chan_r: "channel"},
                    pidfd=life_r is None)
