"""The one cell engine: a cell (or a function) on a gang of ranks, from its command to one outcome.

Every cell goes this one way — a one-shot ``%%ddp`` cell, a pool's cell, ``nbddp.launch`` and
``Pool.run``: subscribers wired on the supervisor's bus (logs, the gang's lifelong view, the cell's
relay behind the stack capture, the cell's dashboard, the engine itself for the ranks' answers), the
deadline (``--timeout``: stacks, then the gang's rule), an interrupt turned into where each rank was,
the failure rules, and one conclusion: each rank's exit record, the root cause, the results.

A one-shot cell is a pool that lives for one cell (``one_shot``: start, run the cell, stop). What
differs between the two is small and named by ``Gang.persistent``:

=====================  ==========================================  ==============================================
                       one-shot (ranks end with the cell)          pool (ranks live on)
=====================  ==========================================  ==============================================
the cell arrives       with the fork (spawn: pickled with the job) on each rank's command pipe
the cell is over       when every rank has exited                  when every rank answered (or one died)
a rank fails           the others are stopped (nothing to keep)    the others are interrupted after PEER_GRACE_S,
                                                                   then a health check decides whether it lives
an interrupt           each rank's stack (faulthandler), then stop KeyboardInterrupt in each cell, health check
--timeout              stacks, then stop                           stacks, then interrupt as above
=====================  ==========================================  ==============================================
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..errors import RankFailure, ResultError
from ..ipy import tracebacks
from ..rank.server import INTERRUPT, Server
from ..views.relay import CellSink, Relay
from ..wire import messages, values
from . import checks, failure, starters
from .gang import Gang
from .supervisor import Bus, Started

PEER_GRACE_S = 1.0  # pool: after a rank failed a cell, how long the others may go on before being interrupted
HEALTH_S = 3.0  # pool: interrupted ranks must answer, and pass a barrier, within this


@dataclass
class Outcome:
    exits: list  # per rank, its failure.RankExit (each with the Result it sent)
    run_dir: str
    wall_s: float
    notes: list  # what a successful cell still has to say (a rank that left early)

    def results(self) -> list:
        """Each rank's Result; an empty one for a rank that ended by its own exit() before sending any."""
        return [e.result or messages.Result() for e in self.exits]


def one_shot(command, config, *, plan=None, namespace=None, observer=None, relabel=None) -> Outcome:
    """A one-shot cell: ranks started for ``command`` (a ``RunCell`` or ``Call``), which they run and leave.
    ``namespace``: the kernel's user_ns, which forked ranks share copy-on-write."""
    plan = checks.preflight(config, plan)
    with checks.one_at_a_time():
        gang = Gang(config, plan, persistent=False)
        job = Server(first=command, namespace=namespace if config.start_method == "fork" else None)
        return CellRun(gang, config, relabel=relabel, observer=observer).run(lambda pipes: job)


def returned(per_rank: list) -> list:
    """Each rank's return value (``nbddp.launch``, ``Pool.run``); one that cannot come back is named."""
    problems = [f"rank {r}'s return value: {res.value.problem}" for r, res in enumerate(per_rank)
                if res.value is not None and res.value.problem]
    if problems:
        raise ResultError("\n".join(problems))
    return [values.loads(res.value.blob) if res.value is not None and res.value.blob is not None else None
            for res in per_rank]


def new_relay(config, run_id: str) -> Relay:
    """The cell's relay, with the config's output options."""
    return Relay(CellSink(run_id), ranks_output=config.ranks_output, prefix=config.prefix, max_lines=config.max_lines,
                 max_line_chars=config.max_line_chars, max_output_mb=config.max_output_mb)


class CellRun:
    """One cell on ``gang``'s ranks. ``run(job_for)`` for a gang not started yet (one-shot: the ranks
    are started with the cell), ``run(command=...)`` for a live one (a pool's)."""

    def __init__(self, gang: Gang, config, *, label: str = "", relabel=None, observer=None):
        self.gang, self.config, self.label, self.observer = gang, config, label[:80], observer
        self.relabel = tracebacks.cell_labels() if relabel is None else relabel
        self.replies: dict[int, object] = {}  # rank -> its answer to the cell (Result, Error or Exit)
        self.healthy: set[int] = set()
        self.first_error: float | None = None
        self.interrupted_at: float | None = None
        self.survived = True

    # -- the ranks' answers, from the supervisor's bus --------------------------------------------------
    def on_Message(self, event) -> None:
        rec = event.record
        if isinstance(rec, messages.Healthy):
            self.healthy.add(event.rank)
        elif isinstance(rec, (messages.Result, messages.Error, messages.Exit)):
            self.replies.setdefault(event.rank, rec)
            failed = isinstance(rec, messages.Error) or (isinstance(rec, messages.Exit) and rec.code != 0)
            if failed and self.first_error is None:  # exit(0) on one rank is an early leave: the others go on
                self.first_error = time.monotonic()

    # -- the cell ------------------------------------------------------------------------------------
    def run(self, job_for=None, *, command=None) -> Outcome:
        gang, sup = self.gang, self.gang.sup
        start = time.monotonic()
        relay = new_relay(self.config, f"{gang.run_dir.run_id}-{gang.view.cells_run if gang.view else 0}")
        stacks = failure.StackCapture(relay)  # the relay behind it: stacks asked for are shown once, trimmed
        sup.bus = Bus([*gang.lifelong(), self, stacks, *([self.observer] if self.observer else [])])
        sup.tick = getattr(self.observer or gang.view, "interval", None)
        sup.new_cell()
        sup.after_stacks = self._interrupt if gang.persistent else sup.stop_all
        for p in sup.procs:  # what a rank said in earlier cells must not explain how this one ends
            p.records.clear()
        deadline = None if self.config.timeout is None else start + self.config.timeout
        if gang.view is not None:
            gang.view.cell_began(self.label)
        error, announced, running = None, gang.started, []
        try:
            if not gang.started:
                gang.start(job_for, deadline)
            else:
                with starters.sigint_deferred():  # a frame half written would leave the ranks out of step
                    gang.command(command)
            if self.observer:  # after the forks: its display costs overlap the ranks' start-up
                self.observer.begin(gang.plan, gang.run_dir)
            if announced:  # a live gang: only the cell's own dashboard has not met the ranks
                for p in sup.procs if self.observer else ():
                    self.observer.on_Started(Started(p.rank, p.pid))
            else:
                sup.announce()
                announced = True
            self._wait(deadline)
        except KeyboardInterrupt as e:
            error = e
            running = self._stop_at_interrupt(announced)
        except BaseException as e:
            error = e
            gang.close(f"torn down: nbddp failed in the kernel ({type(e).__name__}: {e})")
            raise
        finally:
            relay.close_all()
            if self.observer:
                self.observer.finish(error)
            if not gang.persistent:
                gang.close()  # every rank has exited (or was stopped and reaped): the gang ends with the cell
            if gang.view is not None and error is not None:
                gang.view.cell_ended("interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
        if error is not None:
            raise self._interrupted(running, stacks, announced) from None
        try:
            outcome = self._conclude(sup, stacks, start)
        except BaseException:
            if gang.view is not None:
                gang.view.cell_ended("failed")
            raise
        if gang.view is not None:
            gang.view.cell_ended("ok")
        return outcome

    def _wait(self, deadline, until=None, wake_at=None) -> None:
        sup = self.gang.sup
        if not self.gang.persistent:
            sup.wait(deadline)  # until every rank has exited
            return

        def wake():  # the next moment a rule acts (a past one has acted: waking for it again would spin)
            now = time.monotonic()
            marks = [t for t in (wake_at, self.first_error and self.first_error + PEER_GRACE_S,
                                 self.interrupted_at and self.interrupted_at + HEALTH_S) if t and t > now]
            return min(marks) if marks else None

        sup.wait(deadline, until=until or self._cell_over, wake_at=wake)

    def _cell_over(self) -> bool:
        now = time.monotonic()
        if not self.gang.alive or len(self.replies) == self.gang.world_size:
            return True
        if self.first_error is not None and self.interrupted_at is None and now >= self.first_error + PEER_GRACE_S:
            self._interrupt()  # a peer failed: the others would wait for it in their next collective
        return self.interrupted_at is not None and now >= self.interrupted_at + HEALTH_S

    def _interrupt(self) -> None:
        """Pool: KeyboardInterrupt into every rank still running the cell (SIGUSR2)."""
        if self.interrupted_at is None and self.gang.sup is not None:
            self.interrupted_at = time.monotonic()
            for p in self.gang.sup.live():
                if p.rank not in self.replies:
                    try:
                        os.kill(p.pid, INTERRUPT)
                    except ProcessLookupError:
                        pass

    def _stop_at_interrupt(self, announced: bool) -> list[int]:
        """Jupyter's interrupt: which ranks ran the cell; one-shot ranks are asked for their stacks and
        stopped, a pool's get a KeyboardInterrupt in their cell and a health check."""
        gang = self.gang
        if gang.persistent:
            running = [r for r in range(gang.world_size) if r not in self.replies]
            self._interrupt()
            try:
                self._wait(None)
            except KeyboardInterrupt:  # a second interrupt tears the pool down
                gang.close("torn down by a second interrupt")
                self.survived = False
                return running
            self.survived = self._recover()
            return running
        running = gang.sup.request_stacks() if announced else []  # where was each rank? its stack, then stop
        if not announced:
            gang.sup.stop_all()
        gang.sup.reap()  # a second interrupt kills at once
        return running

    def _interrupted(self, running: list[int], stacks, announced: bool) -> KeyboardInterrupt:
        if self.gang.persistent:
            states = self._reply_states(running)
            fate = ("every rank stopped its cell; the pool and its state survived" if self.survived else
                    "the pool was torn down (a rank did not stop its cell), and its ranks' state with it: "
                    "%ddp start to begin again")
        else:
            states = {r: failure.was_at(tracebacks.main_thread(dump), self.relabel, "was not in the cell's code "
                                        "(starting up, or in nbddp's own frames)")
                      for r, dump in stacks.stacks().items()}
            fate = "nbddp stopped every rank" if announced else "nbddp stopped every rank as it started"
        return failure.interrupted(running, states, str(self.gang.run_dir.path), fate)

    def _reply_states(self, running: list[int]) -> dict[int, str]:
        """Where each interrupted rank of a pool was: its KeyboardInterrupt's traceback (user frames only)."""
        states = {}
        for r in running:
            rec = self.replies.get(r)
            if isinstance(rec, messages.Error) and rec.type == "KeyboardInterrupt":
                states[r] = failure.was_at(tracebacks.traceback_frames(rec.traceback), self.relabel,
                                           "stopped (not in the cell's code, or waiting in an `await`)")
            elif isinstance(rec, messages.Error):
                states[r] = f"failed: {rec.type}: {rec.message}"
            elif rec is None:
                states[r] = "did not stop its cell (stuck in native code or in a collective)"
            else:
                states[r] = "finished its cell as the interrupt came"
        return states

    # -- one outcome -----------------------------------------------------------------------------------
    def _conclude(self, sup, stacks, start: float) -> Outcome:
        gang, log_dir = self.gang, str(self.gang.run_dir.path)
        if gang.persistent and not gang.alive:  # a rank died: the pool ends with it
            dead = [p.exit for p in sup.procs if p.exit is not None]
            gang.close("a rank exited")
            err = failure.rank_failed(dead, self.relabel, log_dir) if failure.root_cause(dead) else None
            raise RankFailure((str(err) if err else "a rank of the pool exited") +
                              "\nThe pool has ended and its ranks' state is gone: %ddp start to begin again.",
                              rank=err.rank if err else None, cause=err.cause if err else "exit")
        # one function builds every exit record: from the process's end, or (a pool's) from its answer
        exits = [self._cell_exit(r) for r in range(gang.world_size)] if gang.persistent else [p.exit for p in sup.procs]
        if sup.timed_out:
            err = failure.timed_out(self.config.timeout, sup.timed_out, stacks.stacks(), self.relabel, log_dir,
                                    "their cells were interrupted" if gang.persistent else "all ranks stopped")
            raise self._with_fate(err, self._recover() if gang.persistent else None)
        if failure.root_cause(exits):
            recover = gang.persistent and (self.interrupted_at or len(self.replies) < len(exits))
            err = failure.rank_failed(exits, self.relabel, log_dir)
            raise self._with_fate(err, self._recover() if recover else True if gang.persistent else None)
        return Outcome(exits, log_dir, time.monotonic() - start, failure.notes(exits, self.relabel))

    def _cell_exit(self, rank: int) -> failure.RankExit:
        """A pool rank's exit record for this cell, from its answer (it has not exited)."""
        rec = self.replies.get(rank)
        code = {messages.Result: 0, messages.Error: 1}.get(type(rec), getattr(rec, "code", None))
        records = {type(rec): rec, **({messages.Done: messages.Done()} if isinstance(rec, messages.Result) else {})}
        return failure.exit_record(rank, records if rec is not None else {}, code=code,
                                   stopped=self.interrupted_at is not None or rec is None)

    def _with_fate(self, err: RankFailure, survived: bool | None) -> RankFailure:
        """A pool's failure says what became of the pool."""
        if survived is None:
            return err
        fate = ("The pool and its state survived: fix the cell and run it again." if survived else
                "The pool was torn down (a rank did not come back from a collective), and its ranks' state "
                "with it: %ddp start to begin again.")
        return RankFailure(f"{err}\n{fate}", rank=err.rank, cause=err.cause, stacks=err.stacks)

    def _recover(self) -> bool:
        """Pool, after an interrupt or a failed cell: every rank answered and passes a barrier within
        HEALTH_S, or the pool is torn down. True if it lives on."""
        gang = self.gang
        if gang.alive and len(self.replies) == gang.world_size:
            self.healthy = set()
            end = time.monotonic() + HEALTH_S
            try:
                with starters.sigint_deferred():
                    gang.command(messages.HealthCheck())
                self._wait(None, until=lambda: len(self.healthy) == gang.world_size or time.monotonic() >= end,
                           wake_at=end)
            except KeyboardInterrupt:  # an interrupt during the health check: the pool cannot be vouched for
                gang.close("torn down by an interrupt during its health check")
                return False
            if gang.alive and len(self.healthy) == gang.world_size:
                return True
        gang.close("torn down: a rank did not come back from a collective after the cell failed or was "
                   "interrupted")
        return False
