"""What a rank does, from the instant after fork (or spawn) until ``os._exit``.

Order matters and is the point of this module: first cut every tie to the kernel (die with it,
ignore its SIGINT, own stdout/stderr, never touch its zmq sockets), then make torch safe after a fork
(thread count before any op), then join the process group, run the job, send the result, leave.
Every step is a phase (messages.PHASES); however the rank ends, the channel says so.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from .. import timeline
from ..ipy import tracebacks
from ..wire import framing, messages
from . import debugpanel, inherit, stdio
from .stdio import LIBC, flush_streams

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    accelerator: str  # "cuda" | "cpu"
    backend: str  # "nccl" | "gloo"
    device_id: int | None
    threads: int
    store_path: str
    parent_pid: int
    env: dict = field(default_factory=dict)
    seed: int | None = None
    pg_timeout_s: float = 1800.0
    store_fds: tuple | None = None  # a forked rank's (request, reply) pipes to the kernel's store (spawn: FileStore)
    switch_interval: float | None = None  # the kernel's sys.getswitchinterval(), whatever thread forked the rank
    blocked: tuple = ()  # the signals the kernel's main thread blocks (a fork takes the forking thread's mask)
    generation: int = 0  # of the pool's process group: a replacement for a lost rank joins the survivors' new one
    keeper_pid: int | None = None  # a kept pool's (--keep): the rank dies with its keeper, not with the kernel
    kernel_ports: tuple = ()  # ... and lets go of the kernel's sockets on these ports (session.kernel_ports)


def place_env(rank: int, world_size: int) -> dict:
    """The environment variables that say a rank's place (as torchrun's), for a rank moved to a new one."""
    return {**{k: str(rank) for k in ("RANK", "LOCAL_RANK", "ROLE_RANK", "NBDDP_RANK")},
            **{k: str(world_size) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")}}


@dataclass(frozen=True)
class RankContext:
    """What a job sees: the same names the cell gets."""

    rank: int
    local_rank: int
    world_size: int
    device: object  # torch.device
    channel: object = None  # the rank's framing.Writer (a pool's ranks answer each command on it)
    namespace: object = None  # the rank's globals, where the cells run (a pool's %ddp who and diff read them)
    owned: object = None  # a pool's: the names its cells bound (a set), what a replacement may be healed with


# What every rank imports: imported once in the kernel by %load_ext (``warm_start``), so a fork shares
# them and no rank pays seconds of ``import torch`` per cell. None of them touches CUDA.
RANK_IMPORTS = ("torch", "torch.distributed", "torch.multiprocessing", "nbddp.rank.usergroup", "nbddp.rank.launchers",
                "nbddp.rank.server", "nbddp.rank.libstate", "nbddp.rank.pipestore")


def warm_start(outside_shell: bool = False) -> None:
    """Import what ranks need, in the kernel (no CUDA call: ``import torch`` never initialises it).
    ``outside_shell``: in a process that is no IPython kernel (a Ray agent), also what its forked ranks
    import to get a shell for their displays (``inherit.SHELL_IMPORTS``), once for all of them."""
    import importlib

    from .inherit import SHELL_IMPORTS

    for name in RANK_IMPORTS + (SHELL_IMPORTS if outside_shell else ()):
        importlib.import_module(name)
    from .pipestore import store_class

    store_class()  # the process group's store class (a torch.distributed.Store in Python), made once here


def fork_main(spec: RankSpec, job, *, out_fd: int, err_fd: int, chan_fd: int, close_fds, load_job=None) -> None:
    """Entry point in a freshly forked child (of the kernel, or of the forkserver: ``load_job`` unpickles
    the job in the rank's "job" phase). Never returns."""
    code = 70
    chan = framing.Writer(chan_fd, stdio.marks)
    try:
        # Objects inherited from the kernel are never collected here: the GC skips them (a big
        # notebook heap would slow every collection) and leaves their pages shared with the kernel.
        gc.freeze()
        debugpanel.after_fork()  # the kernel's debugger, if it traced the forking thread, stays in the kernel
        tie_to_parent(spec.parent_pid, spec.keeper_pid, spec.kernel_ports)
        for fd in close_fds:
            _close(fd)
        _own_stdio(out_fd, err_fd)
        code = run_rank(spec, load_job or (lambda: job), chan)
    except BaseException as e:  # noqa: BLE001 - before run_rank took over: still reported
        report(chan, "start", e)
    finally:
        leave(code)


def run_rank(spec: RankSpec, load_job, chan: framing.Writer) -> int:
    """A rank's whole life after its ties to the kernel are cut, phase by phase; every way it can end
    is sent on the channel (Done, Exit or Error with its phase). Returns the exit code."""
    phase = "start"
    try:
        kernel_settings(spec)
        _detach_from_kernel(chan)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
        os.environ.update(spec.env)
        phase = "job"
        job = load_job()
        phase = "threads"
        import torch  # the first thing to touch torch: thread count, before any op (OpenMP fork hazard)

        torch.set_num_threads(spec.threads)
        seed_generators(spec.rank, spec.seed, spec.accelerator)
        phase = "device"
        device = _device(spec, torch)
        phase = "group"
        from . import launchers, usergroup

        launchers.guard_descendants()  # before the group: the guardian must hold none of its sockets
        sockets = usergroup.sockets()
        store = _join_group(spec)
        usergroup.install(usergroup.sockets() - sockets, store=store, generation=spec.generation)
        # launchers the user's code starts meet what they would under torchrun
        launchers.install(torch.distributed.get_rank(), torch.distributed.get_world_size())
        chan.send(messages.Ready())
        phase = "cell"
        local_rank = int(spec.env.get("LOCAL_RANK", spec.rank))  # a cluster pool's: its index on its node
        result = job(RankContext(spec.rank, local_rank, spec.world_size, device, chan))
        if result is not None:  # a one-shot cell's: before leaving, so a peer that left early cannot cost it
            phase = "results"
            flush_streams()
            chan.send(result)
        phase = "leave"
        _leave_group(spec, told=result is None)
        chan.send(messages.Done())
        return 0
    except SystemExit as e:  # sys.exit(), exit(), quit(): the rank ends here, as a script would
        code = exit_code(e)
        flush_streams()
        chan.send(messages.Exit(code, exit_site(e), phase, time.time()))
        if code != 0:
            _held(phase, job)
        return code
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        report(chan, phase, e)
        _held(phase, job)
        return 1


NBDDP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}  # teardown, stacks, a pool's interrupt


def kernel_settings(spec: RankSpec) -> None:
    """The interpreter settings of the kernel's main thread, not of the thread that forked this rank (a
    background cell's lowers the switch interval; a thread may block signals the main thread does not):
    the same rank from a blocking cell and a background one. nbddp's own signals are never blocked."""
    if spec.switch_interval is not None:
        sys.setswitchinterval(spec.switch_interval)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_SETMASK, set(spec.blocked) - NBDDP_SIGNALS)


def seed_generators(rank: int, seed: int | None, accelerator: str = "cpu") -> None:
    """torch, random and numpy start fresh in every rank, as in torchrun's fresh processes (a fork would
    inherit the kernel's state: the same numbers on every rank and every rerun). With ``seed``, rank r's
    generators are seeded from (seed, r): reruns reproduce, ranks still differ. Only generators the
    kernel already has are reseeded (one imported later seeds itself from the OS), and through their
    cheapest calls: torch.manual_seed and importing numpy.random each cost milliseconds per rank."""
    import random

    import torch

    if seed is None:
        value = int.from_bytes(os.urandom(8), "little")
    else:
        import hashlib

        value = int.from_bytes(hashlib.sha256(f"nbddp:{seed}:{rank}".encode()).digest()[:8], "little")
    torch.default_generator.manual_seed(value)
    if accelerator == "cuda":
        torch.cuda.manual_seed_all(value)  # queued until CUDA initialises in the rank
    random.seed(value)
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed(value % 2**32)


def _device(spec: RankSpec, torch):
    if spec.accelerator == "cuda":
        from ..hw import cuda

        return cuda.backend().set_device(spec.device_id)
    return torch.device("cpu")


def _join_group(spec: RankSpec):
    """The default process group, on the kernel's store (or a FileStore); returns that store. A later
    generation's group (a replacement joining a pool that lost a rank) meets under that generation's prefix,
    as the survivors' ``usergroup.regroup`` does."""
    import torch.distributed as dist

    if spec.store_fds is None:
        store = dist.FileStore(spec.store_path, spec.world_size)
    else:  # a forked rank: the kernel's store, over two pipes (no port)
        from . import pipestore

        store = pipestore.connect(*spec.store_fds, spec.pg_timeout_s)
    from .usergroup import generation_store

    dist.init_process_group(
        spec.backend,
        store=generation_store(store, spec.generation),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
    )
    return store


def _leave_group(spec: RankSpec, told: bool) -> None:
    """After the job. On a GPU, finish its queued work first: once synchronised no kernel is in flight, so
    os._exit frees the rest, NCCL's communicators included (the driver releases a dead process's
    context). destroy_process_group would add ~0.4 s of NCCL teardown on an H100 and ~20 ms of FileStore
    polling with gloo (both measured); Lightning's ddp_notebook ranks do not destroy theirs either.
    Every rank must be past its last collective first: ``told`` (the kernel's Stop came once every rank
    had answered), or else (a spawned rank, no command pipe) a barrier on nbddp's own store. Never a
    collective on the user's group: a collective the cell called on one rank only must find no partner
    in nbddp, as under torchrun."""
    if spec.accelerator == "cuda":
        from ..hw import cuda

        cuda.backend().synchronize()
    if not told:
        _store_barrier(spec)


def _store_barrier(spec: RankSpec) -> None:
    import torch.distributed as dist

    store = dist.FileStore(spec.store_path, spec.world_size)
    if store.add("nbddp/left", 1) == spec.world_size:
        store.set("nbddp/all-left", "1")
    else:
        store.wait(["nbddp/all-left"], datetime.timedelta(seconds=spec.pg_timeout_s))


def report(chan: framing.Writer, phase: str, exc: BaseException) -> None:
    flush_streams()
    with contextlib.suppress(KeyError, OSError):  # torch's @record wrote it with the umask's mode: private, as its run
        os.chmod(os.environ["TORCHELASTIC_ERROR_FILE"], 0o600)
    text = tracebacks.user_traceback(exc)  # from the user's code on: not nbddp's frames, nor asyncio's
    try:
        chan.send(messages.Error(phase, type(exc).__name__, str(exc), text, time.time()))
    except OSError:
        pass  # the kernel is gone


def _held(phase: str, job) -> None:
    """A rank that failed a one-shot cell keeps its process, so its connections, until the kernel stops every
    rank (SIGTERM, as soon as its report arrives): a peer waiting for it in a collective is then stopped by
    nbddp, the same on a loaded machine as on an idle one, never failed by a connection closed under it
    ("Connection closed by peer") first. At most ``timeline.HELD_S`` (a kernel that is gone kills it sooner:
    PDEATHSIG). A pool's rank answers a failed cell and lives on: it never gets here with one."""
    if phase == "cell" and getattr(job, "one_shot", False):
        time.sleep(timeline.HELD_S)


def exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def exit_site(exc: SystemExit) -> str:
    f = tracebacks.innermost_user_frame(exc)
    if f is None:
        return ""
    return f'File "{f.filename}", line {f.lineno}' + (f": {f.line.strip()}" if f.line else "")


# -- ties to the parent ---------------------------------------------------------------------------
def tie_to_parent(parent_pid: int, keeper_pid: int | None = None, kernel_ports: tuple = ()) -> None:
    """Die with the kernel (a kept pool's rank: with its keeper instead), ignore Jupyter's group-wide SIGINT, get a
    process group of our own."""
    if keeper_pid is None and sys.platform.startswith("linux"):
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid and keeper_pid is None:  # the parent died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.setpgid(0, 0)  # teardown signals the rank and its own children (DataLoader workers) together
    except OSError:
        pass
    if keeper_pid is not None:  # (after setpgid: the group the watch kills is the rank's own, never the kernel's)
        _die_with(keeper_pid)
        _let_go_of_kernel_sockets(kernel_ports)


def _die_with(pid: int) -> None:
    """The rank ends the instant process ``pid`` does (a kept pool's keeper: nbddp/keeper/), with the processes it
    started (its group: DataLoader workers): a thread waits on its pidfd. A rank outlives its kernel only while its
    keeper lives, and never its keeper."""
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)

    def wait() -> None:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        poll.poll()
        if os.getpgrp() == os.getpid():  # its own group (setpgid took): its children with it
            os.killpg(0, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=wait, name="nbddp-keeper-watch", daemon=True).start()


def _let_go_of_kernel_sockets(ports: tuple) -> None:
    """A kept pool's rank outlives its kernel: the kernel's sockets it inherited on ``ports`` (its zmq ports: shell,
    iopub, stdin, control, heartbeat; listening, and each connection a front end made to them) are closed here. Held
    open, they would keep Jupyter's client talking to a kernel that is gone, and the kernel started again on the same
    ports could not bind them. Its other sockets (one the notebook opened) stay the rank's."""
    import socket
    import stat

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            here = sock.getsockname()
        except OSError:
            here = None
        if isinstance(here, tuple) and here[1] in ports or \
                isinstance(here, str) and here.rpartition("-")[2] in {str(p) for p in ports}:  # ipc transport
            sock.close()
        else:
            sock.detach()


def _own_stdio(out_fd: int, err_fd: int) -> None:
    """fd 1/2 become our pipes (C extensions and subprocesses included); stdin is /dev/null."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in (out_fd, err_fd, null):
        if fd > 2:
            _close(fd)


def _detach_from_kernel(chan: framing.Writer) -> None:
    """New Python streams on fd 1/2, and nothing left that could write to the kernel's zmq sockets."""
    inherit.redirect_in_rank(stdio.install(chan), chan)


def leave(code: int) -> None:
    stdio.flush_each(sys.stdout, sys.stderr)  # (the rank exits next whatever a stream says)
    try:
        LIBC.fflush(None)  # (a foreign call returns its int: only a lookup can fail here)
    except AttributeError:  # a C library without fflush: the rank exits next all the same
        pass
    os._exit(code)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
