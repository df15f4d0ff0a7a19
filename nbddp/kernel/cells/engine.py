"""The one cell engine: a cell (or a function) on a gang of ranks, from its command to one outcome.

Every cell goes this one way — a one-shot ``%%ddp`` cell, a pool's cell, ``nbddp.launch``, ``Pool.run``,
and either in the background: subscribers wired on the supervisor's bus (logs, the gang's lifelong view, the
cell's relay behind the stack capture, the cell's dashboard, the engine itself for the ranks' answers), the
deadline (``--timeout``: stacks, then the kind's rule), an interrupt turned into where each rank was, the
failure rules, and one conclusion: each rank's exit record, the root cause, the results.

What differs by kind of cell (one-shot, pool, background) is asked of the cell's rules (rules.py, where the
table of them is); what happens when is on the supervisor's schedule (``Supervisor.at``): a failed peer's
grace, the probe, a prompt's turn, the relay's releases. The loop's question, whether the cell is over, has
no effect of its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ...errors import RankFailure, ResultError
from ...ipy import tracebacks
from ...rank import copywatch
from ...rank.server import Server
from ...views.relay import CellSink, Relay
from ...wire import messages, values
from .. import checks, metrics, profile
from ..debugger import rankdebug
from ..ranks import failure, starters, warm
from ..ranks.gang import Gang
from ..ranks.stacks import StackCapture
from ..ranks.supervisor import Started
from . import rules
from .probe import CollectiveProbe
from .prompts import Prompts


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
        fork = starters.starter_for(plan).inherits_notebook
        command = profile.asked(command, config, gang.run_dir.path)  # --profile: the traces beside the logs
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

    Its parts, each a listener of the cell or an action on the supervisor's schedule: the ranks' prompts
    (``Prompts``), the stacks asked for (``stacks.StackCapture``, in front of the relay), the collective
    probe (``CollectiveProbe``), the relay's clock (``RelayClock``), and the cell's rules (rules.py: a
    pool's ``Recovery`` among them); what the cell's end says is failure.py's. ``on_start(gang)``: a
    background cell's, called once the ranks have the cell (rules.InBackground)."""

    def __init__(self, gang: Gang, config, *, label: str = "", relabel=None, observer=None, ranks=None,
                 on_start=None):
        self.gang, self.config, self.label, self.observer = gang, config, label[:80], observer
        self.rules = rules.for_cell(gang, on_start)
        self.ranks = tuple(ranks) if ranks else tuple(range(gang.world_size))  # a pool's --ranks: only these run it
        self.prompts = Prompts(gang)  # the ranks' input() and pdb prompts, asked in turn
        self.deadline: float | None = None  # --timeout's, moved on by the time prompts waited for the user
        self.relabel = tracebacks.cell_labels() if relabel is None else relabel
        self.replies: dict[int, object] = {}  # rank -> its answer to the cell (Result, Error or Exit)
        self.first_error: float | None = None  # when the first rank failed the cell
        self.last_reply: float | None = None  # when the last answer came
        self.relay: Relay | None = None
        self.stacks: StackCapture | None = None
        self.probe: CollectiveProbe | None = None
        self.sup = gang.sup  # (kept: a one-shot gang lets go of it as it closes, before the cell concludes)
        self._timers: list = []  # what this engine put on the schedule (the relay's clock aside): see quiet()
        self.metrics = metrics.Recorder(metrics.cell_name(), gang.run_dir.path)  # what the ranks log (nbddp.log)

    # -- the ranks' answers, from the supervisor's bus --------------------------------------------------
    def on_Message(self, event) -> None:
        rec = event.record
        if isinstance(rec, messages.InputRequest):
            self.at(self.prompts.due() or time.monotonic(), self._ask)  # (Prompts, a listener after this, queues it)
        if not isinstance(rec, (messages.Result, messages.Error, messages.Exit)) or event.rank in self.replies:
            return
        self.replies[event.rank] = rec
        self._answered()
        failed = isinstance(rec, messages.Error) or (isinstance(rec, messages.Exit) and rec.code != 0)
        if failed and self.first_error is None:  # exit(0) on one rank is an early leave: the others go on
            self.first_error = time.monotonic()
            self.rules.rank_failed(self)

    def on_Exited(self, event) -> None:
        if not event.exit.stopped:  # (a rank a --ranks cell leaves out too: the cell cannot conclude without it)
            self.rules.rank_lost(self)

    def _answered(self) -> None:
        self.last_reply = time.monotonic()
        if len(self.replies) == self.gang.world_size:
            self.rules.all_answered(self)
        due = self.probe.due(self.last_reply) if self.probe is not None else None
        if due is not None:
            self.at(due, self._probe)

    def at(self, when: float, action) -> None:
        """``action`` at ``when`` on the supervisor's schedule, as this cell's (``quiet`` cancels it)."""
        self._timers.append(self.sup.at(when, action))

    def quiet(self) -> None:
        """The cell's own rules stop acting (a pool's recovery runs the loop next: only the relay's clock
        and the supervisor's own deadlines go on)."""
        for timer in self._timers:
            timer.cancel()
        self._timers = []

    @property
    def on_some_ranks(self) -> bool:
        """A pool's cell on some of its ranks (--ranks)."""
        return len(self.ranks) < self.gang.world_size

    # -- the cell ------------------------------------------------------------------------------------
    def run(self, job_for=None, *, command=None) -> Outcome:
        gang, sup = self.gang, self.sup
        start = time.monotonic()
        self.deadline = None if self.config.timeout is None else start + self.config.timeout
        error, announced, running = None, gang.started, []
        try:
            # a frame half written, or a cell half wired, would leave the ranks out of step: an interrupt
            # is raised once both are done. A pool's ranks get the command first and run it while the
            # kernel wires the cell's listeners (nothing is read before the wait)
            with starters.sigint_deferred():
                if gang.started:
                    command = profile.asked(command, self.config, gang.run_dir.path)
                    gang.command(command, ranks=self.ranks if self.on_some_ranks else None)
                self._begin(sup)
            # the cell's dashboard is shown before the forks: ipykernel's display waits on its IO thread,
            # which ranks that are starting starve of CPU
            if self.observer:
                self.observer.begin(gang.plan, gang.run_dir)
            if not gang.started:
                gang.start(job_for, self.deadline)
            elif self.on_some_ranks:  # the ranks left out are idle: as if they had answered at once
                self._answered()
            if announced:  # a live gang: only the cell's own dashboard has not met the ranks
                for p in sup.procs if self.observer else ():
                    self.observer.on_Started(Started(p.rank, p.pid))
            else:
                sup.announce()
                announced = True
            self.rules.started(self)
            # --timeout moves on by the time the cell's ranks stand stopped in the debugger panel
            stopped0 = rankdebug.stopped_s(p.pid for p in sup.procs)
            self.wait(lambda: None if self.deadline is None else
                      self.deadline + rankdebug.stopped_s(p.pid for p in sup.procs) - stopped0)
        except KeyboardInterrupt as e:
            error = e
            running = self.rules.interrupt(self, announced)
        except BaseException as e:  # nbddp's own failure: the gang closed, re-raised
            error = e
            gang.close(f"torn down: nbddp failed in the kernel ({type(e).__name__}: {e})")
            raise
        finally:
            self._finish(error)
        if error is not None:
            raise self.rules.interrupted(self, running, announced) from None
        ended = "failed"  # (whatever stopped it, an interrupt too)
        try:
            outcome = self._conclude(start)
            ended = "ok"
        finally:
            if gang.view is not None:
                gang.view.cell_ended(ended)
        return outcome

    def _begin(self, sup) -> None:
        """The cell's listeners on the supervisor, with its tick and its --timeout rule."""
        gang = self.gang
        self.relay = relay = new_relay(self.config, f"{gang.run_dir.run_id}-{gang.view.cells_run if gang.view else 0}",
                                       self.ranks)
        self.stacks = StackCapture(relay)  # the relay behind it: stacks asked for are shown once
        self.probe = CollectiveProbe(sup, self.ranks, self.replies, self.stacks, self.relabel,
                                     say=lambda text: relay.sink.write("stderr", text),
                                     on_stranded=self.rules.stranded(self))
        listeners = [self, self.prompts, *self.rules.listeners(self), self.stacks, RelayClock(relay, sup), self.metrics,
                     *([self.observer] if self.observer else [])]
        redraws = gang.view or self.observer  # a pool's view, or the cell's dashboard
        sup.begin_cell(listeners, tick=getattr(redraws, "interval", None),
                       on_timeout=lambda: self.rules.timed_out(self))
        if gang.view is not None:
            gang.view.cell_began(self.label)

    def _finish(self, error) -> None:
        """However the cell ended: the relay's last lines and bars, the dashboard's last state, the rules'
        end (one-shot: the gang closes), modules the ranks imported warmed for the next fork."""
        gang = self.gang
        if self.relay is not None:
            self.relay.close_all()
        self.metrics.finish()
        if self.observer:
            self.observer.finish(error)
        self.rules.end(self)
        warm.learn(m for r in self.replies.values() if isinstance(r, messages.Result) for m in r.imported)
        if gang.view is not None and error is not None:
            gang.view.cell_ended("interrupted" if isinstance(error, KeyboardInterrupt) else "failed")

    def wait(self, deadline, until=None, wake_at=None) -> None:
        """The supervisor's loop until the cell is over (its rules say), or ``until()``."""
        self.sup.wait(deadline, until=until or (lambda: self.rules.over(self)), wake_at=wake_at)

    def wait_for(self, until, wake_at) -> None:
        """The loop until ``until()`` (a pool's recovery: its health check), prompts still answered."""
        self.wait(None, until=until, wake_at=wake_at)

    def _ask(self) -> None:
        """A rank's prompt whose turn it is, asked in the notebook (this waits for the user); the engine's
        clocks move on by that pause, so a debugging session trips no deadline or health rule."""
        refused = self.rules.prompts_refused(self)
        if refused is not None:
            self.prompts.refuse(refused)  # every prompt waiting is answered: no rank waits at its input() for ever
            return
        paused = self.prompts.serve()
        if paused:
            for name in ("deadline", "last_reply", "first_error"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name) + paused)
        if self.prompts.due() is not None:  # another waits its turn
            self.at(self.prompts.due(), self._ask)

    def _probe(self) -> None:
        self.probe.check(self.last_reply, stopping=self.rules.told_to_stop())
        due = self.probe.due(self.last_reply)
        if due is not None and due > time.monotonic():
            self.at(due, self._probe)

    # -- one outcome -----------------------------------------------------------------------------------
    def _conclude(self, start: float) -> Outcome:
        sup, log_dir, rules_ = self.sup, str(self.gang.run_dir.path), self.rules
        self.quiet()
        rules_.check_alive(self)  # a pool whose rank died ends with it
        stranded = self.probe.stranded
        if stranded:
            err = failure.alone(stranded, sorted(r for r in self.replies if r not in stranded), log_dir,
                                idle=[r for r in range(self.gang.world_size) if r not in self.ranks])
            raise rules_.with_fate(self, err, recover=True)
        exits = rules_.exits(self)  # one function builds every exit record: from a process's end, or an answer
        if sup.timed_out:
            err = failure.timed_out(self.config.timeout, sup.timed_out, self.stacks.stacks(), self.relabel, log_dir,
                                    rules_.timeout_fate)
            raise rules_.with_fate(self, err, recover=True)
        cause = failure.root_cause(exits)
        if cause:
            err = failure.rank_failed(exits, self.relabel, log_dir)
            hint = failure.old_group_hint(cause, self.gang.old_group)
            if hint:  # (said before this cell's own regroup, if any, changes what the pool holds)
                err = RankFailure(f"{err}\n{hint}", rank=err.rank, cause=err.cause, stacks=err.stacks)
            # the ranks come back through a recovery if some were told to stop or never answered
            raise rules_.with_fate(self, err, recover=rules_.told_to_stop() or len(self.replies) < len(exits))
        copied = copywatch.note({e.rank: e.result.copied for e in exits if e.result is not None and e.result.copied})
        notes = failure.notes(exits, self.relabel) + ([copied] if copied else [])
        profile.conclude([e.result for e in exits])  # --profile: every rank's summary, shown and kept
        return Outcome(exits, log_dir, time.monotonic() - start, notes)

    def cell_exit(self, rank: int) -> failure.RankExit:
        """A pool rank's exit record for this cell, from its answer (it has not exited)."""
        rec = self.replies.get(rank)
        code = {messages.Result: 0, messages.Error: 1}.get(type(rec), getattr(rec, "code", None))
        records = {type(rec): rec, **({messages.Done: messages.Done()} if isinstance(rec, messages.Result) else {})}
        stopped = self.rules.told_to_stop() or rec is None
        return failure.exit_record(rank, records if rec is not None else {}, code=code, stopped=stopped,
                                   node=self.gang.node_of(rank))


class RelayClock:
    """The relay's releases on the supervisor's schedule: lines held for merging whose wait is over, bars due
    a redraw (``Relay.release_due``, after each event the relay saw, then at the time it names)."""

    def __init__(self, relay: Relay, sup):
        self.relay, self.sup = relay, sup
        self.timer = None

    def arm(self, event=None) -> None:
        due = self.relay.release_due()
        if due is not None and (self.timer is None or self.timer.cancelled or due < self.timer.when):
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.sup.at(due, self.arm)

    on_Output = on_OutputClosed = on_Message = on_Exited = arm
