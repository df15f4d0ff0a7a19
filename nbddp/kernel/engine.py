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
                                                                   then a health check (a barrier); ranks stuck in
                                                                   a collective (gloo) are freed by a fresh group
an interrupt           each rank's stack (faulthandler), then stop KeyboardInterrupt in each cell, health check
--timeout              stacks, then stop                           stacks, then interrupt as above
every rank answered    each told to leave (Stop), then they exit   the cell is over; the ranks wait for the next
a rank alone in a      ALONE_S on: the cell fails naming it, the   the same; every rank leaves the process group
collective             ranks are stopped                           and makes a fresh one (Regroup): the pool lives
=====================  ==========================================  ==============================================
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import RankFailure, ResultError
from ..ipy import tracebacks
from ..rank import copywatch
from ..rank.server import INTERRUPT, Server
from ..views.relay import CellSink, Relay
from ..wire import messages, values
from . import checks, failure, starters, warm
from .gang import Gang
from .probe import CollectiveProbe
from .prompts import Prompts
from .recovery import HEALTH_S, Recovery
from .supervisor import Started

PEER_GRACE_S = 1.0  # pool: after a rank failed a cell, how long the others may go on before being interrupted


@dataclass
class Outcome:
    exits: list  # per rank, its failure.RankExit (each with the Result it sent)
    run_dir: str
    wall_s: float
    notes: list  # what a successful cell still has to say (a rank that left early)

    def results(self) -> list:
        """Each rank's Result; an empty one for a rank that ended by its own exit() before sending any."""
        return [e.result or messages.Result() for e in self.exits]


def one_shot(command, config, *, plan=None, namespace=None, observer=None, relabel=None, on_start=None) -> Outcome:
    """A one-shot cell: ranks started for ``command`` (a ``RunCell`` or ``Call``), which they run and leave.
    ``namespace``: the kernel's user_ns, which forked ranks share copy-on-write; ``on_start(gang)``: see CellRun."""
    plan = plan or checks.preflight(config)  # a caller that passes the plan ran preflight itself
    with checks.one_at_a_time():
        gang = Gang(config, plan, persistent=False)
        fork = config.start_method == "fork"
        return CellRun(gang, config, relabel=relabel, observer=observer, on_start=on_start).run(
            lambda pipes: Server(first=command, cmd_pipes=pipes, namespace=namespace if fork else None))


def returned(per_rank: list) -> list:
    """Each rank's return value (``nbddp.launch``, ``Pool.run``); one that cannot come back is named."""
    problems = [f"rank {r}'s return value: {res.value.problem}" for r, res in enumerate(per_rank)
                if res.value is not None and res.value.problem]
    if problems:
        raise ResultError("\n".join(problems))
    return [values.loads(res.value.blob) if res.value is not None and res.value.blob is not None else None
            for res in per_rank]


def new_relay(config, run_id: str, ranks=(0,)) -> Relay:
    """The cell's relay, with the config's output options; ``ranks``: those running the cell."""
    return Relay(CellSink(run_id), ranks_output=config.ranks_output, prefix=config.prefix, max_lines=config.max_lines,
                 max_line_chars=config.max_line_chars, max_output_mb=config.max_output_mb, ranks=ranks)


class CellRun:
    """One cell on ``gang``'s ranks: its conversation with them. ``run(job_for)`` for a gang not started
    yet (one-shot: the ranks are started with the cell), ``run(command=...)`` for a live one (a pool's).

    Its parts, each a listener of the cell or called from its wait: the ranks' prompts (``Prompts``), the
    stacks asked for (``failure.StackCapture``, in front of the relay), the collective probe
    (``CollectiveProbe``), a pool's recovery (``Recovery``); what the cell's end says is failure.py's.
    ``on_start(gang)``: called once the ranks have the cell (a background cell's: from then on it can be
    interrupted through ``gang.sup``, and the notebook goes on)."""

    def __init__(self, gang: Gang, config, *, label: str = "", relabel=None, observer=None, ranks=None,
                 on_start=None):
        self.gang, self.config, self.label, self.observer = gang, config, label[:80], observer
        self.on_start = on_start
        self.ranks = tuple(ranks) if ranks else tuple(range(gang.world_size))  # a pool's --ranks: only these run it
        self.prompts = Prompts(gang)  # the ranks' input() and pdb prompts, asked in the notebook in turn
        self.deadline: float | None = None  # --timeout's, moved on by the time prompts waited for the user
        self.relabel = tracebacks.cell_labels() if relabel is None else relabel
        self.replies: dict[int, object] = {}  # rank -> its answer to the cell (Result, Error or Exit)
        self.first_error: float | None = None  # when the first rank failed the cell
        self.interrupted_at: float | None = None  # pool: when the ranks still running were interrupted
        self.last_reply: float | None = None  # when the last answer came
        self.leave_sent = False  # one-shot: Stop sent (leave), every rank having answered
        self.survived = True  # pool: whether it lives on after an interrupt
        self.relay: Relay | None = None
        self.stacks: failure.StackCapture | None = None
        self.probe: CollectiveProbe | None = None
        self.recovery = Recovery(gang, self.ranks, self.replies, self._wait_for) if gang.persistent else None

    # -- the ranks' answers, from the supervisor's bus --------------------------------------------------
    def on_Message(self, event) -> None:
        rec = event.record
        if isinstance(rec, (messages.Result, messages.Error, messages.Exit)):
            self.replies.setdefault(event.rank, rec)
            self.last_reply = time.monotonic()
            failed = isinstance(rec, messages.Error) or (isinstance(rec, messages.Exit) and rec.code != 0)
            if failed and self.first_error is None:  # exit(0) on one rank is an early leave: the others go on
                self.first_error = time.monotonic()

    @property
    def on_some_ranks(self) -> bool:
        """A pool's cell on some of its ranks (--ranks)."""
        return len(self.ranks) < self.gang.world_size

    # -- the cell ------------------------------------------------------------------------------------
    def run(self, job_for=None, *, command=None) -> Outcome:
        gang, sup = self.gang, self.gang.sup
        start = time.monotonic()
        self.deadline = None if self.config.timeout is None else start + self.config.timeout
        error, announced, running = None, gang.started, []
        try:
            # a frame half written, or a cell half wired, would leave the ranks out of step: an interrupt
            # is raised once both are done. A pool's ranks get the command first and run it while the
            # kernel wires the cell's listeners (nothing is read before the wait)
            with starters.sigint_deferred():
                if gang.started:
                    gang.command(command, ranks=self.ranks if self.on_some_ranks else None)
                self._begin(sup)
            # the cell's dashboard is shown before the forks: ipykernel's display waits on its IO thread,
            # which ranks that are starting starve of CPU
            if self.observer:
                self.observer.begin(gang.plan, gang.run_dir)
            if not gang.started:
                gang.start(job_for, self.deadline)
            elif self.on_some_ranks:  # the ranks left out are idle: as if they had answered at once
                self.last_reply = time.monotonic()
            if announced:  # a live gang: only the cell's own dashboard has not met the ranks
                for p in sup.procs if self.observer else ():
                    self.observer.on_Started(Started(p.rank, p.pid))
            else:
                sup.announce()
                announced = True
            if self.on_start is not None:
                self.on_start(gang)
            self._wait(lambda: self.deadline)
        except KeyboardInterrupt as e:
            error = e
            running = self._stop_at_interrupt(announced)
        except BaseException as e:
            error = e
            gang.close(f"torn down: nbddp failed in the kernel ({type(e).__name__}: {e})")
            raise
        finally:
            if self.relay is not None:
                self.relay.close_all()
            if self.observer:
                self.observer.finish(error)
            if not gang.persistent:
                gang.close()  # every rank has exited (or was stopped and reaped): the gang ends with the cell
            warm.learn(m for r in self.replies.values() if isinstance(r, messages.Result) for m in r.imported)
            if gang.view is not None and error is not None:
                gang.view.cell_ended("interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
        if error is not None:
            raise self._interrupted(running, announced) from None
        try:
            outcome = self._conclude(sup, start)
        except BaseException:
            if gang.view is not None:
                gang.view.cell_ended("failed")
            raise
        if gang.view is not None:
            gang.view.cell_ended("ok")
        return outcome

    def _begin(self, sup) -> None:
        """The cell's listeners on the supervisor, with its tick and its --timeout rule."""
        gang = self.gang
        self.relay = relay = new_relay(self.config, f"{gang.run_dir.run_id}-{gang.view.cells_run if gang.view else 0}",
                                       self.ranks)
        self.stacks = failure.StackCapture(relay)  # the relay behind it: stacks asked for are shown once
        self.probe = CollectiveProbe(sup, self.ranks, self.replies, self.stacks, self.relabel,
                                     say=lambda text: relay.sink.write("stderr", text),
                                     on_stranded=None if gang.persistent else sup.stop_all)
        listeners = [self, self.prompts, *([self.recovery] if self.recovery else []), self.stacks,
                     *([self.observer] if self.observer else [])]
        redraws = gang.view or self.observer  # a pool's view, or the cell's dashboard
        sup.begin_cell(listeners, tick=getattr(redraws, "interval", None), on_timeout=self._timeout_rule)
        if gang.view is not None:
            gang.view.cell_began(self.label)

    def _wait(self, deadline, until=None, wake_at=None) -> None:
        def wake():  # the next moment a rule acts (a past one has acted: waking for it again would spin)
            now = time.monotonic()
            marks = [t for t in (wake_at, self.first_error and self.first_error + PEER_GRACE_S,
                                 self.interrupted_at and self.interrupted_at + HEALTH_S,
                                 self.probe.due(self.last_reply), self.prompts.due(),
                                 self.relay and self.relay.release_due()) if t and t > now]
            return min(marks) if marks else None

        over = self._cell_over if self.gang.persistent else self._one_shot_over
        self.gang.sup.wait(deadline, until=until or over, wake_at=wake)

    def _wait_for(self, until, wake_at) -> None:
        """The loop until ``until()`` (a pool's recovery: its health check), prompts still answered."""
        self._wait(None, until=until, wake_at=wake_at)

    def _ask(self) -> None:
        """A rank's prompt whose turn it is, asked in the notebook (this waits for the user); the engine's
        clocks move on by that pause, so a debugging session trips no deadline or health rule."""
        if self.interrupted_at is not None:  # the ranks were told to stop: nothing more to ask
            self.prompts.drop()
            return
        paused = self.prompts.serve()
        if paused:
            for name in ("deadline", "last_reply", "first_error"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name) + paused)

    def _probe(self) -> None:
        self.probe.check(self.last_reply, stopping=self.interrupted_at is not None)

    def _one_shot_over(self) -> bool:
        """One-shot: once every rank has answered, each is told to leave (nbddp's own synchronisation, on
        the command pipes: never a collective on the user's group); over when every rank has exited."""
        self._ask()
        if self.gang.piped and not self.leave_sent and len(self.replies) == self.gang.world_size:
            self.leave_sent = True
            self.gang.command(messages.Stop())
        self._probe()
        return False

    def _cell_over(self) -> bool:
        self._ask()
        now = time.monotonic()
        if not self.gang.alive or set(self.replies) >= set(self.ranks):
            return True
        self._probe()
        if self.probe.stranded:  # in a collective no peer will join: it cannot be interrupted, and the pool cannot live on
            return True
        if self.first_error is not None and self.interrupted_at is None and now >= self.first_error + PEER_GRACE_S:
            self._interrupt()  # a peer failed: the others would wait for it in their next collective
        return self.interrupted_at is not None and now >= self.interrupted_at + HEALTH_S

    def _timeout_rule(self) -> None:
        """Once --timeout's stacks are in: a pool's ranks are interrupted, one-shot ranks stopped."""
        if self.gang.persistent:
            self._interrupt()
        else:
            self.gang.sup.stop_all()

    def _interrupt(self) -> None:
        """Pool: KeyboardInterrupt into every rank still running the cell (SIGUSR2)."""
        if self.interrupted_at is None and self.gang.sup is not None:
            self.interrupted_at = time.monotonic()
            for p in self.gang.sup.live():
                if p.rank in self.ranks and p.rank not in self.replies:
                    p.signal(INTERRUPT, group=False)

    def _stop_at_interrupt(self, announced: bool) -> list[int]:
        """Jupyter's interrupt: which ranks ran the cell; one-shot ranks are asked for their stacks and
        stopped, a pool's get a KeyboardInterrupt in their cell and a health check."""
        gang = self.gang
        if gang.persistent:
            running = [r for r in self.ranks if r not in self.replies]
            self._interrupt()
            try:
                self._wait(None)
            except KeyboardInterrupt:  # a second interrupt tears the pool down
                gang.close("torn down by a second interrupt")
                self.survived = False
                return running
            self.survived = self.recovery.recover()
            return running
        sup = gang.sup  # where was each rank? its stack, then stop
        asked = sup.request_stacks(then=sup.stop_all) if announced else []
        running = [r for r in asked if r not in self.replies]  # (one that answered waits only to leave)
        if not announced:
            sup.stop_all()
        sup.reap()  # a second interrupt kills at once
        return running

    def _interrupted(self, running: list[int], announced: bool) -> KeyboardInterrupt:
        if self.gang.persistent:
            states = failure.reply_states(running, self.replies, self.relabel)
            fate = failure.interrupt_fate(self.survived, self.recovery.regrouped)
        else:
            states = {r: failure.was_at(tracebacks.main_thread(dump), self.relabel, "was not in the cell's code "
                                        "(starting up, or in nbddp's own frames)")
                      for r, dump in self.stacks.stacks().items()}
            fate = "nbddp stopped every rank" if announced else "nbddp stopped every rank as it started"
        return failure.interrupted(running, states, str(self.gang.run_dir.path), fate)

    # -- one outcome -----------------------------------------------------------------------------------
    def _conclude(self, sup, start: float) -> Outcome:
        gang, log_dir = self.gang, str(self.gang.run_dir.path)
        if gang.persistent and not gang.alive:  # a rank died: the pool ends with it
            dead = [p.exit for p in sup.procs if p.exit is not None]
            gang.close("a rank exited")
            err = failure.rank_failed(dead, self.relabel, log_dir) if failure.root_cause(dead) else None
            raise RankFailure((str(err) if err else "a rank of the pool exited") +
                              "\nThe pool has ended and its ranks' state is gone: %ddp start to begin again.",
                              rank=err.rank if err else None, cause=err.cause if err else "exit")
        stranded = self.probe.stranded
        if stranded:
            err = failure.alone(stranded, sorted(r for r in self.replies if r not in stranded), log_dir,
                                idle=[r for r in range(gang.world_size) if r not in self.ranks])
            raise self._with_fate(err, self.recovery.recover() if gang.persistent else None)
        # one function builds every exit record: from the process's end, or (a pool's) from its answer
        exits = [self._cell_exit(r) for r in self.ranks] if gang.persistent else [p.exit for p in sup.procs]
        if sup.timed_out:
            err = failure.timed_out(self.config.timeout, sup.timed_out, self.stacks.stacks(), self.relabel, log_dir,
                                    "their cells were interrupted" if gang.persistent else "all ranks stopped")
            raise self._with_fate(err, self.recovery.recover() if gang.persistent else None)
        cause = failure.root_cause(exits)
        if cause:
            recover = gang.persistent and (self.interrupted_at or len(self.replies) < len(exits))
            err = failure.rank_failed(exits, self.relabel, log_dir)
            hint = failure.old_group_hint(cause, gang.old_group) if gang.persistent else ""
            if hint:  # (said before this cell's own regroup, if any, changes what the pool holds)
                err = RankFailure(f"{err}\n{hint}", rank=err.rank, cause=err.cause, stacks=err.stacks)
            raise self._with_fate(err, self.recovery.recover() if recover else True if gang.persistent else None)
        copied = copywatch.note({e.rank: e.result.copied for e in exits if e.result is not None and e.result.copied})
        notes = failure.notes(exits, self.relabel) + ([copied] if copied else [])
        return Outcome(exits, log_dir, time.monotonic() - start, notes)

    def _cell_exit(self, rank: int) -> failure.RankExit:
        """A pool rank's exit record for this cell, from its answer (it has not exited)."""
        rec = self.replies.get(rank)
        code = {messages.Result: 0, messages.Error: 1}.get(type(rec), getattr(rec, "code", None))
        records = {type(rec): rec, **({messages.Done: messages.Done()} if isinstance(rec, messages.Result) else {})}
        return failure.exit_record(rank, records if rec is not None else {}, code=code,
                                   stopped=self.interrupted_at is not None or rec is None, node=self.gang.node_of(rank))

    def _with_fate(self, err: RankFailure, survived: bool | None) -> RankFailure:
        """A pool's failure says what became of the pool (``survived`` None: a one-shot cell's, as it is)."""
        if survived is None:
            return err
        fate = failure.pool_fate(survived, self.recovery.regrouped, self.recovery.old_group_users)
        return RankFailure(f"{err}\n{fate}", rank=err.rank, cause=err.cause, stacks=err.stacks)
