"""Start one rank per device and supervise them from the kernel's main thread until all are gone.

One small class per start method (fork, spawn), one supervisor loop shared by both. The loop waits
on events only: each rank's stdout/stderr/result pipes and its pidfd (readable the instant the
process exits; where a platform has no pidfds, a "life pipe" the rank holds open, which reads EOF when
it exits). Its only timeouts are real deadlines (``--timeout``, teardown grace, the dashboard's
1 Hz tick), so no polling interval ever lands in the user's wait.
"""
from __future__ import annotations

import contextlib
import os
import selectors
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

from . import cuda, devices, failure, rendezvous, results
from .errors import CudaInitialisedError, UsageError
from .relay import Relay, TextSink
from .worker import LIBC, READY, RankSpec, fork_main

# Python 3.12+ warns on every fork of a multithreaded process, and a kernel always is one: nbddp's
# ranks only run the cell and exit through os._exit, and worker.py makes torch safe first.
warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning,
                        module=__name__)

GRACE_S = 3.0  # SIGTERM -> SIGKILL, like torch.elastic
STACK_QUIET_S = 0.3  # after SIGUSR1 at a timeout: stacks are complete once stderr is quiet this long
STACK_MAX_S = 2.0


@dataclass
class Config:
    devices: object = "auto"
    accelerator: str = "auto"
    backend: str = "auto"
    start_method: str = "fork"
    threads: int = 1
    timeout: float | None = None
    ranks_output: str = "all"
    prefix: bool = True
    max_lines: int = 200_000

    def validate(self) -> devices.Plan:
        if self.start_method not in ("fork", "spawn"):
            raise UsageError(f"--start-method {self.start_method!r}: choose fork or spawn.")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise UsageError(f"--threads {self.threads!r}: need a whole number >= 1.")
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError(f"--timeout {self.timeout!r}: need a number of seconds > 0.")
        if not isinstance(self.max_lines, int) or self.max_lines < 0:
            raise UsageError(f"--max-lines {self.max_lines!r}: need a whole number >= 0.")
        if self.ranks_output not in ("all", "0", "none"):
            raise UsageError(f"--ranks-output {self.ranks_output!r}: choose all, 0 or none.")
        if not hasattr(os, "posix_spawn"):
            raise UsageError(
                f"nbddp runs ranks on Linux and macOS; {sys.platform} has neither fork nor posix_spawn.\n"
                "On Windows, run the notebook inside WSL2 (CUDA and NCCL work there)."
            )
        if self.start_method == "fork" and not fork_available():
            raise UsageError(
                f"fork is not available on {sys.platform}: use --start-method spawn "
                "(the cell and the globals it uses are shipped with cloudpickle)."
            )
        return devices.plan(self.devices, self.accelerator, self.backend)


def fork_available() -> bool:
    return hasattr(os, "fork")


def _life_pipe() -> tuple[int, int] | tuple[None, None]:
    """Where there are no pidfds (macOS): a pipe whose write end only the rank holds."""
    return (None, None) if hasattr(os, "pidfd_open") else os.pipe()


@dataclass
class Outcome:
    values: list  # per rank, what the job returned
    run_dir: str
    wall_s: float


@dataclass
class RankProc:
    rank: int
    pid: int
    exit_fd: int  # a pidfd, or the read end of the rank's life pipe
    fds: dict = field(default_factory=dict)  # fd -> stream name ("stdout" | "stderr" | "result")
    result: bytearray = field(default_factory=bytearray)
    exit: failure.RankExit | None = None
    stop_sent: bool = False


_active = False  # one launch at a time per process


def run(job, config: Config, *, plan: devices.Plan | None = None, sink=None, observer=None,
        relabel: dict | None = None) -> Outcome:
    """Run ``job(ctx)`` on every rank; return each rank's value or raise a RankFailure.

    ``plan``: ``config.validate()``'s result, when the caller already has it."""
    global _active
    if os.environ.get("NBDDP_RANK") is not None:
        raise UsageError(
            "nbddp cannot launch from inside a rank (nested %%ddp / launch).\n"
            "The cell already runs on every rank: call the code directly."
        )
    if _active:
        raise UsageError("another nbddp launch is still running in this process; wait for it to finish.")
    plan = plan or config.validate()
    if plan.accelerator == "cuda" and config.start_method == "fork" and cuda.backend().initialised_in_kernel():
        raise _cuda_initialised()
    _active = True
    try:
        return _run(job, config, plan, sink, observer, relabel or {})
    finally:
        _active = False


def _run(job, config: Config, plan: devices.Plan, sink, observer, relabel: dict) -> Outcome:
    run_dir = rendezvous.new_run_dir()
    relay = Relay(
        sink or TextSink(),
        ranks_output=config.ranks_output,
        prefix=config.prefix,
        log_paths={r: str(run_dir.log(r)) for r in range(plan.world_size)},
        max_lines=config.max_lines,
    )
    start = time.monotonic()
    sup = Supervisor(relay, observer)
    starter = (ForkStarter if config.start_method == "fork" else SpawnStarter)(run_dir)
    error = None
    try:
        ifname = rendezvous.loopback_ifname()
        port = rendezvous.free_port()
        specs = [
            RankSpec(
                rank=rank,
                world_size=plan.world_size,
                accelerator=plan.accelerator,
                backend=plan.backend,
                device_id=dev,
                threads=config.threads,
                store_path=str(run_dir.store),
                parent_pid=os.getpid(),
                env=_rank_env(plan, rank, run_dir.run_id, port, config.threads, ifname),
            )
            for rank, dev in enumerate(plan.device_ids)
        ]
        with _sigint_deferred():  # an interrupt now would lose track of a rank just forked
            for spec in specs:  # nothing else between forks: rank 0 waits for the last one to rendezvous
                sup.add(starter.start(spec, job, sup.all_fds()))
        if observer:  # after the forks: its display costs overlap the ranks' start-up
            observer.begin(plan, run_dir, relay)
        sup.announce()
        deadline = None if config.timeout is None else start + config.timeout
        sup.wait(deadline)
    except BaseException as e:
        error = e
        sup.stop_all()
        sup.reap()
        raise
    finally:
        sup.close()
        relay.close_all()
        run_dir.release_store()
        starter.cleanup()
        if observer:
            observer.finish(error)
    exits = [p.exit for p in sup.procs]
    if sup.timed_out:
        raise failure.timed_out(config.timeout, sup.timed_out, sup.stacks, relabel, str(run_dir.path))
    if failure.root_cause(exits):
        raise failure.rank_failed(exits, relabel, str(run_dir.path))
    values = [p.exit.message.get("value") for p in sup.procs]
    return Outcome(values, str(run_dir.path), time.monotonic() - start)


@contextlib.contextmanager
def _sigint_deferred():
    """Hold an interrupt back while ranks are forked and registered, then raise it.

    A signal mask would not do: Jupyter's SIGINT goes to the whole process, and any of the kernel's
    other threads takes it; so the handler itself is swapped for one that only takes note.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted:
            raise KeyboardInterrupt


def _rank_env(plan, rank, run_id, port, threads, ifname) -> dict:
    env = rendezvous.torchrun_env(
        rank=rank, world_size=plan.world_size, run_id=run_id, master_port=port, threads=threads, ifname=ifname
    )
    if plan.backend == "nccl":
        from . import nccl

        env.update({k: v for k, v in nccl.rank_env(ifname).items() if k not in os.environ})
    return env


def _cuda_initialised() -> CudaInitialisedError:
    site = getattr(cuda.backend(), "site", None)
    where = f"CUDA was initialised in this kernel by {site}." if site else (
        "CUDA is already initialised in this kernel (by a library, or torch.cuda calls that create a context)."
    )
    return CudaInitialisedError(
        f"{where}\nA forked rank cannot use a GPU once the kernel holds a CUDA context, so nothing was launched.\n"
        "Fix: restart the kernel and move every .cuda()/.to('cuda') into the %%ddp cell "
        "(build datasets on the CPU in the notebook),\n"
        "or rerun with --start-method spawn (slower start; the cell's globals are pickled)."
    )


# -- start methods ----------------------------------------------------------------------------------
class ForkStarter:
    """The default: a fork of the kernel, so notebook data is shared copy-on-write."""

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def start(self, spec: RankSpec, job, inherited_fds: list[int]) -> RankProc:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        life_r, life_w = _life_pipe()
        LIBC.fflush(None)  # C-level buffers would otherwise be written again by the child
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; fork_main never returns (life_w stays open)
            fork_main(spec, job, out_fd=out_w, err_fd=err_w, result_fd=res_w,
                      close_fds=[*inherited_fds, out_r, err_r, res_r, *([life_r] if life_r is not None else [])])
        return _parent_side(pid, spec.rank, out_r, err_r, res_r, (out_w, err_w, res_w), (life_r, life_w))

    def cleanup(self) -> None:
        pass


class SpawnStarter:
    """A fresh interpreter per rank: for platforms without fork, or a kernel that already uses CUDA."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.job_path = run_dir.path / "job.pkl"

    def start(self, spec: RankSpec, job, inherited_fds: list[int]) -> RankProc:
        if not self.job_path.exists():
            fd = os.open(self.job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(results.dumps(job))
        spec_path = self.run_dir.path / f"spec{spec.rank}.pkl"
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(results.dumps(spec))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        life_r, life_w = _life_pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        pid = os.posix_spawn(
            sys.executable,
            [sys.executable, "-m", "nbddp._spawn", str(spec_path), str(self.job_path)],
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
                (os.POSIX_SPAWN_DUP2, res_w, 3),
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                *([(os.POSIX_SPAWN_DUP2, life_w, 4)] if life_w is not None else []),
            ],
            setpgroup=0,
        )
        return _parent_side(pid, spec.rank, out_r, err_r, res_r, (out_w, err_w, res_w), (life_r, life_w))

    def cleanup(self) -> None:
        for p in self.run_dir.path.glob("*.pkl"):
            p.unlink(missing_ok=True)


def _parent_side(pid, rank, out_r, err_r, res_r, child_ends, life) -> RankProc:
    life_r, life_w = life
    for fd in (*child_ends, *([life_w] if life_w is not None else [])):
        os.close(fd)
    try:
        os.setpgid(pid, pid)  # also done in the child; whichever runs first wins the race
    except OSError:
        pass
    exit_fd = life_r if life_r is not None else os.pidfd_open(pid)
    return RankProc(rank, pid, exit_fd, {out_r: "stdout", err_r: "stderr", res_r: "result"})


# -- supervision ------------------------------------------------------------------------------------
class Supervisor:
    def __init__(self, relay: Relay, observer=None):
        self.relay = relay
        self.observer = observer
        self.procs: list[RankProc] = []
        self.sel = selectors.DefaultSelector()
        self.kill_at: float | None = None
        self.timed_out: list[int] = []
        self.stacks: dict[int, str] = {}
        self._seen = 0

    def add(self, proc: RankProc) -> None:
        self.procs.append(proc)
        for fd in proc.fds:
            self.sel.register(fd, selectors.EVENT_READ, (proc, proc.fds[fd]))
        self.sel.register(proc.exit_fd, selectors.EVENT_READ, (proc, "exit"))

    def announce(self) -> None:
        """Tell the observer about every rank, once all are forked."""
        if self.observer:
            for proc in self.procs:
                self.observer.started(proc.rank, proc.pid)

    def all_fds(self) -> list[int]:
        return [fd for p in self.procs for fd in (*p.fds, p.exit_fd)]

    def live(self) -> list[RankProc]:
        return [p for p in self.procs if p.exit is None]

    def wait(self, deadline: float | None) -> None:
        tick = getattr(self.observer, "interval", None)
        next_tick = time.monotonic() + tick if tick else None
        while self.live():
            now = time.monotonic()
            wake = [t for t in (deadline, self.kill_at, next_tick) if t is not None]
            timeout = max(0.0, min(wake) - now) if wake else None
            for key, _ in self.sel.select(timeout):
                self._event(*key.data, key.fd)
            now = time.monotonic()
            if deadline is not None and now >= deadline and self.live() and not self.timed_out:
                self._expire()
                deadline = None
            if self.kill_at is not None and now >= self.kill_at:
                self._kill_live()
            if next_tick is not None and now >= next_tick:
                self.observer.tick()
                next_tick = now + tick

    def _event(self, proc: RankProc, kind: str, fd: int) -> None:
        if (kind == "exit" and proc.exit is not None) or (kind != "exit" and fd not in proc.fds):
            return  # closed earlier in this same batch of events (the rank's exit drained it)
        if kind == "exit":
            self._exited(proc)
            return
        data = _read(fd)
        if data:
            self._data(proc, kind, data)
        else:
            self._close_fd(proc, fd)

    def _data(self, proc: RankProc, kind: str, data: bytes) -> None:
        if kind == "result":
            if not proc.result and data[:1] == READY and self.observer:
                self.observer.running(proc.rank)
            proc.result += data
        else:
            self.relay.feed(proc.rank, kind, data)

    def _close_fd(self, proc: RankProc, fd: int) -> None:
        kind = proc.fds.pop(fd)
        self.sel.unregister(fd)
        os.close(fd)
        if kind != "result":
            self.relay.close(proc.rank, kind)

    def _exited(self, proc: RankProc) -> None:
        # Everything the rank wrote is in its pipes now; a grandchild may hold them open, so drain
        # what is there instead of waiting for EOF. The group dies before the reap (pid still reserved).
        for fd in list(proc.fds):
            os.set_blocking(fd, False)
            while data := _read(fd):
                self._data(proc, proc.fds[fd], data)
            self._close_fd(proc, fd)
        _signal_group(proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
        self.sel.unregister(proc.exit_fd)
        os.close(proc.exit_fd)
        proc.exit_fd = -1
        blob = results.unframe(bytes(proc.result[len(READY):] if proc.result[:1] == READY else proc.result))
        message = _load(blob) if blob is not None else None
        self._seen += 1
        # "stopped" only if our signal ended it: a rank that reported its own error failed by itself
        stopped = proc.stop_sent and not (message and message.get("kind"))
        proc.exit = failure.RankExit(proc.rank, os.waitstatus_to_exitcode(status), message, stopped, self._seen,
                                     max_rss=usage.ru_maxrss * 1024, seen=time.time())
        if self.observer:
            self.observer.exited(proc.rank, proc.exit)
        if not proc.exit.ok and not proc.stop_sent:
            self.stop_all()

    def stop_all(self) -> None:
        """SIGTERM every live rank (and its children); SIGKILL after the grace period."""
        for p in self.live():
            if not p.stop_sent:
                p.stop_sent = True
                _signal_group(p.pid, signal.SIGTERM)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + GRACE_S

    def _kill_live(self) -> None:
        for p in self.live():
            _signal_group(p.pid, signal.SIGKILL)
        self.kill_at = None

    def _expire(self) -> None:
        """--timeout: ask every live rank for its Python stack (faulthandler on SIGUSR1), then stop all."""
        live = self.live()
        self.timed_out = [p.rank for p in live]
        self.relay.start_capture()
        for p in live:
            _signal_group(p.pid, signal.SIGUSR1)  # issue10: every process of the rank's group shows its stack
        end = time.monotonic() + STACK_MAX_S
        quiet_until = time.monotonic() + STACK_QUIET_S
        while time.monotonic() < min(end, quiet_until):
            events = self.sel.select(max(0.0, min(end, quiet_until) - time.monotonic()))
            for key, _ in events:
                proc, kind = key.data
                if kind == "stderr":
                    quiet_until = time.monotonic() + STACK_QUIET_S
                self._event(proc, kind, key.fd)
        self.stacks = self.relay.captured()
        self.stop_all()

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


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


def _load(blob: bytes):
    try:
        return results.loads(blob)
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "kind": "result", "type": "result", "message": f"cannot unpickle in the kernel: {e}"}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
