"""Start one rank per device and supervise them from the kernel's main thread until all are gone.

``Config`` is the one source of every option's default. One small class per start method (fork,
spawn) gives each rank three pipes (stdout, stderr, its typed channel); supervisor.py's loop reads
them and publishes events to the relay, the logs, the dashboard and the timeout report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass

from . import cuda, devices, failure, openmp, rendezvous, results, tracebacks
from .channel import Result
from .errors import UsageError
from .relay import CellSink, RankLogs, Relay
from .supervisor import Bus, RankProc, Supervisor
from .worker import LIBC, RankSpec, fork_main

# Python 3.12+ warns on every fork of a multithreaded process, and a kernel always is one: nbddp's
# ranks only run the cell and exit through os._exit, and worker.py makes torch safe first.
warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning,
                        module=__name__)


@dataclass(kw_only=True)
class Config:
    """Every option of a run, with its default: the magic, ``nbddp.launch`` and the docs read them here."""

    devices: object = "auto"
    accelerator: str = "auto"
    backend: str = "auto"
    start_method: str = "fork"
    threads: int = 1
    timeout: float | None = None
    ranks_output: str = "all"
    prefix: bool = True
    max_lines: int = 200_000
    max_line_chars: int = 10_000
    max_output_mb: float = 20.0
    max_value_mb: float = results.DEFAULT_MAX_VALUE_MB
    seed: int | None = None  # None: fresh entropy per rank and run, as under torchrun

    @classmethod
    def from_options(cls, options: dict) -> "Config":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise UsageError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(names)}.")
        return cls(**options)

    @property
    def max_value_bytes(self) -> int:
        return int(self.max_value_mb * 2**20)

    def validate(self) -> devices.Plan:
        if self.start_method not in ("fork", "spawn"):
            raise UsageError(f"--start-method {self.start_method!r}: choose fork or spawn.")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise UsageError(f"--threads {self.threads!r}: need a whole number >= 1.")
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError(f"--timeout {self.timeout!r}: need a number of seconds > 0.")
        if not isinstance(self.max_lines, int) or self.max_lines < 0:
            raise UsageError(f"--max-lines {self.max_lines!r}: need a whole number >= 0.")
        if not isinstance(self.max_line_chars, int) or self.max_line_chars < 1:
            raise UsageError(f"--max-line-chars {self.max_line_chars!r}: need a whole number >= 1.")
        if not isinstance(self.max_output_mb, (int, float)) or not self.max_output_mb >= 0:
            raise UsageError(f"--max-output-mb {self.max_output_mb!r}: need a size in MiB >= 0.")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise UsageError(f"--seed {self.seed!r}: need a whole number >= 0.")
        if not isinstance(self.max_value_mb, (int, float)) or not self.max_value_mb > 0:
            raise UsageError(f"--max-value-mb {self.max_value_mb!r}: need a size in MiB > 0.")
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


DEFAULTS = Config()


@dataclass
class Outcome:
    exits: list  # per rank, its failure.RankExit (each with the Result it sent)
    run_dir: str
    wall_s: float
    notes: list  # what a successful run still has to say (a rank that left early)

    def results(self) -> list:
        """Each rank's Result; an empty one for a rank that ended by its own exit() before sending any."""
        return [e.result or Result() for e in self.exits]


_active = False  # one launch at a time per process


def run(job, config: Config, *, plan: devices.Plan | None = None, observer=None,
        relabel: dict | None = None) -> Outcome:
    """Run ``job(ctx)`` on every rank; return each rank's value or raise a RankFailure.

    ``plan``: ``config.validate()``'s result, when the caller already has it."""
    global _active
    plan = check_launch(config, plan)
    _active = True
    try:
        return _run(job, config, plan, observer, tracebacks.cell_labels() if relabel is None else relabel)
    finally:
        _active = False


def check_launch(config: Config, plan: devices.Plan | None = None) -> devices.Plan:
    """Everything that must hold before a rank is forked (one-shot or pool); returns the plan."""
    if os.environ.get("NBDDP_RANK") is not None:
        raise UsageError(
            "nbddp cannot launch from inside a rank (nested %%ddp / launch).\n"
            "The cell already runs on every rank: call the code directly."
        )
    if _active:
        raise UsageError("another nbddp launch is still running in this process; wait for it to finish.")
    plan = plan or config.validate()
    for note in [*plan.notes, *_oversubscribed(plan, config.threads)]:  # e.g. busy GPUs --devices auto skipped
        print(note, file=sys.stderr)
    if plan.accelerator == "cuda" and config.start_method == "fork" and (refusal := cuda.backend().refusal()):
        raise refusal
    if config.start_method == "fork":
        openmp.release_threads(config.threads)  # last: nothing runs a parallel op between this and the forks
    return plan


_warned_oversubscribed: set = set()


def _oversubscribed(plan: devices.Plan, threads: int) -> list[str]:
    """Many more CPU ranks than cores: said once per kernel and world size (it runs, slowly)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = plan.world_size * threads
    if plan.accelerator != "cpu" or want <= cores or (plan.world_size, threads) in _warned_oversubscribed:
        return []
    _warned_oversubscribed.add((plan.world_size, threads))
    per = f" x {threads} threads" if threads > 1 else ""
    return [f"nbddp: {plan.world_size} CPU ranks{per} on {cores} cores: they take turns on the cores and every "
            f"collective waits for the slowest, so steps run far slower than on {max(1, cores // threads)} rank(s). "
            "Fine for trying code at this world size; interrupt and --timeout still stop every rank."]


def fork_ranks(sup: Supervisor, starter, job, config: Config, plan: devices.Plan, run_dir,
               deadline: float | None = None) -> None:
    """One rank per device, registered with the supervisor as soon as it exists. Past ``deadline``
    (--timeout) no more are forked: hundreds of CPU ranks on a few cores can take minutes to fork."""
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
            seed=config.seed,
            store_path=str(run_dir.store),
            parent_pid=os.getpid(),
            env=_rank_env(plan, rank, run_dir.run_id, port, config.threads, ifname),
        )
        for rank, dev in enumerate(plan.device_ids)
    ]
    with _sigint_deferred() as interrupted:  # a rank forked is registered before an interrupt is raised
        for spec in specs:  # nothing else between forks: rank 0 waits for the last one to rendezvous
            sup.add(starter.start(spec, job, sup.all_fds()))
            if interrupted or (deadline is not None and time.monotonic() >= deadline):
                break  # an interrupt is raised on leaving; the supervisor then finds the deadline passed


def _run(job, config: Config, plan: devices.Plan, observer, relabel) -> Outcome:
    run_dir = rendezvous.new_run_dir()
    relay = new_relay(config, run_dir.run_id)
    logs = RankLogs({r: str(run_dir.log(r)) for r in range(plan.world_size)})
    stacks = failure.StackCapture(relay)  # the relay behind it: stacks asked for are shown once, trimmed
    bus = Bus([logs, stacks, *([observer] if observer else [])])
    start = time.monotonic()
    sup = Supervisor(bus, tick=getattr(observer, "interval", None))
    starter = (ForkStarter if config.start_method == "fork" else SpawnStarter)(run_dir)
    error = None
    announced = False
    running = []  # at an interrupt: the ranks still running the cell
    try:
        deadline = None if config.timeout is None else start + config.timeout
        fork_ranks(sup, starter, job, config, plan, run_dir, deadline)
        if observer:  # after the forks: its display costs overlap the ranks' start-up
            observer.begin(plan, run_dir)
        sup.announce()
        announced = True
        sup.wait(deadline)
    except BaseException as e:
        error = e
        if isinstance(e, KeyboardInterrupt) and announced:
            running = sup.request_stacks()  # Jupyter's interrupt: where was each rank? its stack, then stop
        else:
            sup.stop_all()
        sup.reap()  # a second interrupt kills at once
        if not isinstance(e, KeyboardInterrupt):
            raise
    finally:
        sup.close()
        relay.close_all()
        logs.close()
        run_dir.release_store()
        starter.cleanup()
        if observer:
            observer.finish(error)
    if isinstance(error, KeyboardInterrupt):
        states = {r: failure.was_at(tracebacks.main_thread(dump), relabel, "was not in the cell's code (starting up, "
                                    "or in nbddp's own frames)") for r, dump in stacks.stacks().items()}
        fate = "nbddp stopped every rank" if announced else "nbddp stopped every rank as it started"
        raise failure.interrupted(running, states, str(run_dir.path), fate) from None
    exits = [p.exit for p in sup.procs]
    if sup.timed_out:
        raise failure.timed_out(config.timeout, sup.timed_out, stacks.stacks(), relabel, str(run_dir.path))
    if failure.root_cause(exits):
        raise failure.rank_failed(exits, relabel, str(run_dir.path))
    return Outcome(exits, str(run_dir.path), time.monotonic() - start, failure.notes(exits, relabel))


def new_relay(config: Config, run_id: str) -> Relay:
    """The cell's relay (one-shot or a pool's cell), with the config's output options."""
    return Relay(CellSink(run_id), ranks_output=config.ranks_output, prefix=config.prefix, max_lines=config.max_lines,
                 max_line_chars=config.max_line_chars, max_output_mb=config.max_output_mb)


@contextlib.contextmanager
def _sigint_deferred():
    """Hold an interrupt back while a rank is forked and registered; yields the (truthy once
    interrupted) list of interrupts noted, and raises at the end if the body did not.

    A signal mask would not do: Jupyter's SIGINT goes to the whole process, and any of the kernel's
    other threads takes it; so the handler itself is swapped for one that only takes note.
    """
    noted = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield noted
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


# -- start methods ----------------------------------------------------------------------------------
class ForkStarter:
    """The default: a fork of the kernel, so notebook data is shared copy-on-write."""

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def start(self, spec: RankSpec, job, inherited_fds: list[int]) -> RankProc:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        chan_r, chan_w = os.pipe()
        life_r, life_w = _life_pipe()
        LIBC.fflush(None)  # C-level buffers would otherwise be written again by the child
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; fork_main never returns (life_w stays open)
            fork_main(spec, job, out_fd=out_w, err_fd=err_w, chan_fd=chan_w,
                      close_fds=[*inherited_fds, out_r, err_r, chan_r, *([life_r] if life_r is not None else [])])
        return _parent_side(pid, spec.rank, out_r, err_r, chan_r, (out_w, err_w, chan_w), (life_r, life_w))

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
        chan_r, chan_w = os.pipe()
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


def _parent_side(pid, rank, out_r, err_r, chan_r, child_ends, life) -> RankProc:
    life_r, life_w = life
    for fd in (*child_ends, *([life_w] if life_w is not None else [])):
        os.close(fd)
    try:
        os.setpgid(pid, pid)  # also done in the child; whichever runs first wins the race
    except OSError:
        pass
    exit_fd = life_r if life_r is not None else os.pidfd_open(pid)
    return RankProc(rank, pid, exit_fd, {out_r: "stdout", err_r: "stderr", chan_r: "channel"})
