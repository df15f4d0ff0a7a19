"""A pool: ranks forked from the kernel once, living across cells (``%ddp start``, ``nbddp.Pool``).

The ranks share the notebook's data as it was at the start, copy-on-write, and join the process group
once; each ``%%ddp`` cell is then a command on every rank's command pipe, answered on its channel. A
notebook name a cell reads that was created or rebound since the start is sent once (``Synced``).

Failure rules (docs/user-guide.md says them too):
- an exception on every rank fails the cell; the pool and its state stay;
- an exception on some ranks while others still run: those are interrupted after ``PEER_GRACE_S``; if
  every rank answers and a health check (a barrier) passes within ``HEALTH_S``, the pool lives on,
  otherwise (a rank stuck in a collective) it is torn down; the message says which;
- a rank that dies ends the pool, naming the rank and the cause;
- an interrupt raises KeyboardInterrupt in every rank's running cell, then the same health check;
- ``--timeout`` shows every rank's stack, then interrupts as above.
"""
from __future__ import annotations

import os
import sys
import time
import types
import weakref

import cloudpickle

from . import channel, failure, launcher, rendezvous, tracebacks
from .errors import RankFailure, UsageError
from .poolrank import INTERRUPT, PoolServer
from .display import view_for_pool
from .relay import RankLogs
from .supervisor import Bus, Started, Supervisor

PEER_GRACE_S = 1.0  # after a rank failed a cell: how long the others may go on before being interrupted
HEALTH_S = 3.0  # interrupted ranks must answer, and pass a barrier, within this
START_S = 600.0  # the ranks of a new pool must all be in the process group by then
BIG_UPDATE = 16 * 2**20  # a sent value this large earns the hint that %ddp restart shares it instead
NO_POOL = "no pool is running (%ddp start [options] starts one)"
POOL_OPTIONS = ("devices", "accelerator", "backend", "start_method", "threads", "seed")  # fixed for the pool's life


class Pool:
    """``with nbddp.Pool(devices=2) as pool: pool.run(fn, *args)`` — or ``%ddp start`` in a notebook."""

    def __init__(self, namespace: dict | None = None, **options):
        self.config = launcher.Config.from_options(options)
        self.namespace = namespace
        self.sup: Supervisor | None = None
        self.view = None  # its dashboard (poolview.PoolView), from start() on

    # -- life --------------------------------------------------------------------------------------
    def start(self) -> "Pool":
        if self.config.start_method != "fork":
            raise UsageError("a pool forks its ranks from the kernel (that is how they share the notebook's data); "
                             "--start-method spawn works for one-shot %%ddp cells only.")
        self.plan = launcher.check_launch(self.config)
        self.run_dir = rendezvous.new_run_dir()
        self.logs = RankLogs({r: str(self.run_dir.log(r)) for r in range(self.plan.world_size)})
        self.view = view_for_pool(self.plan, self.run_dir)
        self.sup = Supervisor(Bus([self.logs, self, self.view]))
        self.sup.after_stacks = self._interrupt
        self._ready: set[int] = set()
        self._reset_cell()
        pipes = {r: os.pipe() for r in range(self.plan.world_size)}
        self._cmd = {r: w for r, (_, w) in pipes.items()}
        starter = launcher.ForkStarter(self.run_dir)
        try:
            launcher.fork_ranks(self.sup, starter, PoolServer(pipes, self.namespace), self.config, self.plan,
                                self.run_dir)
        except BaseException:
            self._teardown()
            raise
        finally:
            for read, _ in pipes.values():
                os.close(read)
        self.started_at = time.time()
        self.synced = Synced(self.namespace or {})
        self.rank_assigned: set[str] = set()
        self.sup.announce()
        end = time.monotonic() + START_S
        try:
            self._wait(lambda: len(self._ready) == self.plan.world_size or time.monotonic() >= end, None, end)
        except BaseException:
            self._teardown()
            raise
        if len(self._ready) < self.plan.world_size:
            exits = [p.exit for p in self.sup.procs if p.exit is not None]
            self._teardown()
            raise failure.rank_failed(exits, {}, str(self.run_dir.path)) if failure.root_cause(exits) else \
                RankFailure(f"the pool's ranks did not come up within {START_S:g} s; nothing is left running.",
                            rank=None, cause="start")
        return self

    def show(self) -> None:
        """Display the pool's dashboard here (``%ddp start`` and ``%ddp status`` do): one live output."""
        self.view.show()

    @property
    def alive(self) -> bool:
        return self.sup is not None and len(self.sup.live()) == self.plan.world_size

    def stop(self) -> None:
        """Ask every rank to leave the group and exit; SIGTERM/SIGKILL whoever does not within 5 s."""
        if self.sup is None:
            return
        end = time.monotonic() + 5
        try:
            self._command(channel.Stop())
            self.sup.wait(None, until=lambda: time.monotonic() >= end, wake_at=end)
        finally:
            self._teardown("stopped")

    def __enter__(self) -> "Pool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _teardown(self, why: str = "ended: torn down") -> None:
        if self.sup is None:
            return
        dead = [p.rank for p in self.sup.procs if p.exit is not None]
        self.view.finish(why if why == "stopped" or not dead else f"ended: rank {dead[0]} exited")
        sup, self.sup = self.sup, None
        sup.stop_all()
        sup.reap()
        sup.close()
        for fd in getattr(self, "_cmd", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._cmd = {}
        self.logs.close()
        self.run_dir.release_store()

    # -- events from the supervisor ------------------------------------------------------------------
    def on_Message(self, event) -> None:
        rec = event.record
        if isinstance(rec, channel.Ready):
            self._ready.add(event.rank)
        elif isinstance(rec, channel.Healthy):
            self._healthy.add(event.rank)
        elif isinstance(rec, (channel.Result, channel.Error, channel.Exit)):
            self._replies.setdefault(event.rank, rec)
            if isinstance(rec, (channel.Error, channel.Exit)) and self._first_error is None:
                self._first_error = time.monotonic()

    def _reset_cell(self) -> None:
        self._healthy: set[int] = set()
        self._replies: dict[int, object] = {}
        self._first_error: float | None = None
        self._interrupted_at: float | None = None

    # -- a cell ------------------------------------------------------------------------------------
    def run(self, fn, *args) -> list:
        """``fn(*args)`` on every rank, in the pool; each rank's return value, in rank order."""
        from . import _Call, results

        blob = cloudpickle.dumps(_Call(fn, args, self.config.max_value_bytes))
        per_rank = self.execute(channel.Call(blob), label=getattr(fn, "__name__", "call"))
        return [results.loads(r.value.blob) if r.value is not None and r.value.blob is not None else None
                for r in per_rank]

    def cell(self, source: str, filename: str, *, outs=(), gathers=(), code=None, relabel=None,
             observer=None, **per_cell) -> list:
        """A %%ddp cell in the pool; each rank's Result. ``code``: the cell compiled (names it reads)."""
        config = launcher.Config.from_options({**{k: getattr(self.config, k) for k in POOL_OPTIONS}, **per_cell})
        updates, said = self.synced.changes(code or set(), self.namespace or {}, self.rank_assigned)
        self.rank_assigned -= set(updates)
        for line in said:
            print(f"nbddp: {line}", file=sys.stderr)
        if said:
            sys.stderr.flush()  # before the ranks' output, where it belongs
        cmd = channel.RunCell(source, filename, tuple(outs), tuple(gathers), config.max_value_bytes, updates)
        label = (relabel or {}).get(filename) or (source.strip().splitlines() or [""])[0]
        per_rank = self.execute(cmd, label=label,
                                config=config, relabel=relabel, observer=observer)
        for res in per_rank:
            self.rank_assigned |= set(res.assigned)
        return per_rank

    def execute(self, cmd, *, label: str, config=None, relabel=None, observer=None) -> list:
        if not self.alive:
            raise UsageError("the pool is not running: %ddp start (or Pool.start()) first.")
        config = config or self.config
        relabel = tracebacks.cell_labels() if relabel is None else relabel
        relay = launcher.new_relay(config, f"{self.run_dir.run_id}-{self.view.cells_run}")
        stacks = failure.StackCapture(relay)  # the relay behind it: stacks asked for are shown once, trimmed
        self.sup.bus = Bus([self.logs, self, self.view, stacks, *([observer] if observer else [])])
        self.sup.tick = self.view.interval
        self.sup.timed_out = []
        self._reset_cell()
        for p in self.sup.procs:  # what a rank said in earlier cells must not explain how this one ends
            p.records.clear()
        if observer:
            observer.begin(self.plan, self.run_dir)
            for p in self.sup.procs:
                observer.on_Started(Started(p.rank, p.pid))
        self.view.cell_began(label[:80])
        error = None
        running = []
        try:
            self._command(cmd)
            deadline = None if config.timeout is None else time.monotonic() + config.timeout
            try:
                self._wait(self._cell_over, deadline)
            except KeyboardInterrupt:
                running = [r for r in range(self.plan.world_size) if r not in self._replies]
                self._interrupt()
                self._wait(self._cell_over, None)  # a second interrupt tears the pool down
                raise
        except BaseException as e:
            error = e
            if not isinstance(e, KeyboardInterrupt):
                self._teardown()
                raise
            survived = self._recover()
            states = self._interrupted_states(running, relabel)
            if not survived:
                self._teardown()
            raise failure.interrupted(
                running, states, str(self.run_dir.path),
                "every rank stopped its cell; the pool and its state survived" if survived else
                "the pool was torn down (a rank did not stop its cell), and its ranks' state with it: "
                "%ddp start to begin again") from None
        finally:
            relay.close_all()
            if observer:
                observer.finish(error)
            if error is not None:
                self.view.cell_ended("interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
        try:
            per_rank = self._conclude(stacks, config, relabel)
        except BaseException:
            self.view.cell_ended("failed")
            raise
        self.view.cell_ended("ok")
        return per_rank

    def _conclude(self, stacks, config, relabel) -> list:
        log_dir = str(self.run_dir.path)
        if not self.alive:  # a rank died: the pool ends with it
            exits = [p.exit for p in self.sup.procs if p.exit is not None]
            self._teardown()
            err = failure.rank_failed(exits, relabel, log_dir) if failure.root_cause(exits) else None
            raise RankFailure((str(err) if err else "a rank of the pool exited") +
                              "\nThe pool has ended and its ranks' state is gone: %ddp start to begin again.",
                              rank=err.rank if err else None, cause=err.cause if err else "exit")
        exits = [self._cell_exit(r) for r in range(self.plan.world_size)]
        if self.sup.timed_out:
            survived = self._recover()
            err = failure.timed_out(config.timeout, self.sup.timed_out, stacks.stacks(), relabel, log_dir)
            raise RankFailure(str(err) + "\n" + self._fate(survived), rank=err.rank, cause="timeout",
                              stacks=err.stacks)
        if failure.root_cause(exits):
            survived = self._recover() if (self._interrupted_at or len(self._replies) < len(exits)) else True
            err = failure.rank_failed(exits, relabel, log_dir)
            raise RankFailure(str(err) + "\n" + self._fate(survived), rank=err.rank, cause=err.cause)
        return [e.result or channel.Result() for e in exits]

    def _interrupted_states(self, running: list[int], relabel) -> dict[int, str]:
        """Where each interrupted rank was: its KeyboardInterrupt's traceback (user frames only)."""
        states = {}
        for r in running:
            rec = self._replies.get(r)
            if isinstance(rec, channel.Error) and rec.type == "KeyboardInterrupt":
                states[r] = failure.was_at(tracebacks.traceback_frames(rec.traceback), relabel,
                                           "stopped (not in the cell's code, or waiting in an `await`)")
            elif isinstance(rec, channel.Error):
                states[r] = f"failed: {rec.type}: {rec.message}"
            elif rec is None:
                states[r] = "did not stop its cell (stuck in native code or in a collective)"
            else:
                states[r] = "finished its cell as the interrupt came"
        return states

    def _cell_exit(self, rank: int) -> failure.RankExit:
        rec = self._replies.get(rank)
        if isinstance(rec, channel.Result):
            return failure.RankExit(rank, 0, result=rec, done=True)
        if isinstance(rec, channel.Exit):
            return failure.RankExit(rank, rec.code, left=rec)
        if isinstance(rec, channel.Error):
            ours = self._interrupted_at is not None and rec.type == "KeyboardInterrupt"
            return failure.RankExit(rank, 1, error=rec, stopped=ours)
        return failure.RankExit(rank, None, stopped=True)  # never answered: stuck, torn down

    def _fate(self, survived: bool) -> str:
        if survived:
            return "The pool and its state survived: fix the cell and run it again."
        return ("The pool was torn down (a rank did not come back from a collective), and its ranks' state "
                "with it: %ddp start to begin again.")

    def _cell_over(self) -> bool:
        now = time.monotonic()
        if not self.alive or len(self._replies) == self.plan.world_size:
            return True
        if self._first_error is not None and self._interrupted_at is None and now >= self._first_error + PEER_GRACE_S:
            self._interrupt()  # a peer failed: the others would wait for it in their next collective
        return self._interrupted_at is not None and now >= self._interrupted_at + HEALTH_S

    def _interrupt(self) -> None:
        if self._interrupted_at is None and self.sup is not None:
            self._interrupted_at = time.monotonic()
            for p in self.sup.live():
                if p.rank not in self._replies:
                    try:
                        os.kill(p.pid, INTERRUPT)
                    except ProcessLookupError:
                        pass

    def _recover(self) -> bool:
        """After an interrupt or a failed cell: every rank answered and passes a barrier within
        HEALTH_S, or the pool is torn down. True if it lives on."""
        if self.alive and len(self._replies) == self.plan.world_size:
            self._healthy = set()
            self._command(channel.HealthCheck())
            end = time.monotonic() + HEALTH_S
            self._wait(lambda: len(self._healthy) == self.plan.world_size or time.monotonic() >= end, None, end)
            if self.alive and len(self._healthy) == self.plan.world_size:
                return True
        self._teardown()
        return False

    def _wait(self, until, deadline, wake_at=None) -> None:
        def wake():
            marks = [t for t in (wake_at, self._first_error and self._first_error + PEER_GRACE_S,
                                 self._interrupted_at and self._interrupted_at + HEALTH_S) if t]
            return min(marks) if marks else None

        self.sup.wait(deadline, until=until, wake_at=wake)

    def _command(self, cmd) -> None:
        frame = channel.encode(cmd)
        for rank, fd in self._cmd.items():
            view = memoryview(frame)
            try:
                while view:
                    view = view[os.write(fd, view):]
            except BrokenPipeError:
                pass  # that rank is gone; the supervisor reports how

    # -- what %ddp status shows ------------------------------------------------------------------------
    def status(self) -> str:
        if not self.alive:
            return NO_POOL
        self.view.sample(uss=True)
        return self.view.render_text()

    def conflicts(self, explicit: dict) -> list[str]:
        """Options a %%ddp cell gave that the running pool cannot honour."""
        return [f"--{k.replace('_', '-')} {v} (the pool has {getattr(self.config, k)})"
                for k, v in explicit.items() if k in POOL_OPTIONS and str(v) != str(getattr(self.config, k))]


class Synced:
    """Which notebook values the ranks have: a name the notebook created or rebound since the pool
    started (or since it was last sent) is sent again; one the ranks assigned themselves stays theirs
    unless the notebook rebinds it too."""

    def __init__(self, namespace: dict):
        self._known = {k: _token(v) for k, v in namespace.items()}

    def accept(self, names, namespace: dict) -> None:
        """Names the notebook just received from the ranks (--out, --gather): not changes to send back."""
        for name in names:
            if name in namespace:
                self._known[name] = _token(namespace[name])

    def changes(self, names, namespace: dict, rank_assigned: set) -> tuple[dict, list[str]]:
        from .cell import _IPYTHON_HISTORY, _IPYTHON_NAMES
        from .results import describe

        updates, sizes, both = {}, [], []
        for name in sorted(names):
            if name not in namespace or name in _IPYTHON_NAMES or _IPYTHON_HISTORY.match(name):
                continue
            value = namespace[name]
            if isinstance(value, types.ModuleType) or _same(self._known.get(name), value):
                continue
            try:
                blob = cloudpickle.dumps(value)
            except Exception as e:  # noqa: BLE001
                raise UsageError(f"`{name}` changed in the notebook since %ddp start and must be sent to every "
                                 f"rank, but it cannot be pickled: {type(e).__name__}: {e}\nNothing ran. "
                                 "Create it inside a %%ddp cell, or %ddp restart (the ranks then share it).") from None
            updates[name] = blob
            self._known[name] = _token(value)
            sizes.append(f"{name} ({describe(value)}, {_size(len(blob))})")
            if name in rank_assigned:
                both.append(name)
        said = []
        if updates:
            total = sum(len(b) for b in updates.values())
            said.append(f"sent {', '.join(sizes)} to every rank (new or rebound in the notebook since the pool "
                        "started)" + ("; %ddp restart shares big data copy-on-write instead" if total >= BIG_UPDATE
                                      else ""))
        if both:
            said.append(f"{', '.join(both)} changed both in the notebook and on the ranks: the ranks now use "
                        "the notebook's value")
        return updates, said


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None))


def _token(value):
    if isinstance(value, _IMMUTABLE):
        return ("v", type(value), value)
    try:
        return ("w", weakref.ref(value))
    except TypeError:
        return ("i", id(value))


def _same(token, value) -> bool:
    if token is None:
        return False
    kind = token[0]
    if kind == "v":
        return type(value) is token[1] and value == token[2]
    if kind == "w":
        return token[1]() is value
    return token[1] == id(value)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} B"

