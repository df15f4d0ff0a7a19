"""The rules of each kind of cell, one small object each, every kind an explicit class of one declared
interface (``CellRules``, as torch elastic's ``PContext`` is one for every way workers start): when the cell
is over, what a failed rank, a timeout and an interrupt do, whether a rank's prompt may be asked, and what
becomes of the ranks. The engine (engine.CellRun) asks them instead of branching; they act through the
cell's run (its gang, its supervisor's schedule, its answers).

=====================  ==========================================  ==============================================
                       ``OneShot`` (ranks end with the cell)       ``Pool`` (ranks live on)
=====================  ==========================================  ==============================================
the cell arrives       with the fork (spawn: pickled with the job) on each rank's command pipe
the cell is over       when every rank has exited                  when every rank answered (or one died)
a rank fails           every rank is stopped on its report         the others are interrupted after PEER_GRACE_S
                                                                   (sooner once all wait: grace.py), then a
                                                                   health check (a barrier); ranks stuck in
                                                                   a collective (gloo) are freed by a fresh group
an interrupt           each rank's stack (faulthandler), then stop KeyboardInterrupt in each cell, health check
--timeout              stacks, then stop                           stacks, then interrupt as above
every rank answered    each told to leave (Stop), then they exit   the cell is over; the ranks wait for the next
a rank alone in a      ALONE_S on: the cell fails naming it, the   the same; every rank leaves the process group
collective             ranks are stopped                           and makes a fresh one (Regroup): the pool lives
=====================  ==========================================  ==============================================

``BackgroundOneShotRules`` and ``BackgroundPoolRules`` (``%%ddp --bg``, kernel/cells/background.py) are either kind
run on the background thread (``InBackground``): the notebook goes on once the ranks have the cell
(``started``), and a rank's prompt is answered with the error a front end without an input box gives (the
request that could answer it has ended: ``prompts_refused``). Their interrupt arrives through
``Supervisor.interrupt`` and is handled as the kind's.

One rule for prompts: ``prompts_refused(run)`` is None while a prompt may be asked, else the reason, with
which every prompt waiting is answered (never dropped: a rank waits at its ``input()`` for its answer).
"""
from __future__ import annotations

import abc
import time

from ... import timeline
from ...errors import RankFailure
from ...ipy import tracebacks
from ...rank.server import INTERRUPT
from ...wire import messages
from ..ranks import failure
from .grace import Grace
from .recovery import Recovery


class CellRules(abc.ABC):
    """What the engine asks of a kind of cell; ``run`` is the cell's engine.CellRun."""

    timeout_fate: str  # what --timeout did to the ranks, as the cell's report says it

    @abc.abstractmethod
    def listeners(self, run) -> list:
        """Bus subscribers of the cell's own (a pool's Recovery)."""

    def started(self, run) -> None:  # noqa: B027 - a hook: nothing, unless a kind of cell says
        """The ranks have the cell."""

    def rank_lost(self, run) -> None:  # noqa: B027 - a hook: nothing, unless a kind of cell says
        """A rank died during the cell (its exit known: a pool that mends itself keeps its peers up)."""

    @abc.abstractmethod
    def prompts_refused(self, run) -> str | None:
        """None while a rank's input() or pdb prompt may be asked in the notebook; else why not, which is
        what every prompt waiting is answered with."""

    @abc.abstractmethod
    def told_to_stop(self) -> bool:
        """The ranks still running the cell were told to stop."""

    @abc.abstractmethod
    def over(self, run) -> bool:
        """The engine's question to the supervisor's loop (no effect of its own)."""

    @abc.abstractmethod
    def all_answered(self, run) -> None:
        """Every rank answered the cell."""

    @abc.abstractmethod
    def rank_failed(self, run) -> None:
        """A rank failed the cell (the first to: an exception, or an exit other than 0)."""

    @abc.abstractmethod
    def timed_out(self, run) -> None:
        """--timeout passed (the stacks were taken)."""

    @abc.abstractmethod
    def stranded(self, run):
        """A rank alone in a collective: what the probe does then (a callable), or None."""

    @abc.abstractmethod
    def interrupt(self, run, announced: bool) -> list[int]:
        """Jupyter's interrupt (or %ddp interrupt): acted on; the ranks that were still running the cell."""

    @abc.abstractmethod
    def interrupted(self, run, running: list[int], announced: bool) -> KeyboardInterrupt:
        """The KeyboardInterrupt the cell raises, saying where each rank was."""

    @abc.abstractmethod
    def check_alive(self, run) -> None:
        """Raises if the gang can no longer answer (a pool's rank died)."""

    @abc.abstractmethod
    def exits(self, run) -> list:
        """Each rank's exit record for the cell's conclusion."""

    @abc.abstractmethod
    def with_fate(self, run, err: RankFailure, recover: bool) -> RankFailure:
        """A failure, with what became of the ranks."""

    @abc.abstractmethod
    def end(self, run) -> None:
        """The cell is concluded."""


class OneShotRules(CellRules):
    """A one-shot cell: a pool that lives for one cell (its ranks were started for it)."""

    timeout_fate = "all ranks stopped"

    def __init__(self):
        self.leave_sent = False

    def listeners(self, run) -> list:
        return []

    def prompts_refused(self, run) -> str | None:
        return None  # a rank's input() and pdb prompts are asked in the notebook

    def told_to_stop(self) -> bool:
        return False  # (its ranks are stopped, not told)

    def over(self, run) -> bool:
        return False  # over once every rank has exited: the supervisor's loop ends then

    def all_answered(self, run) -> None:
        """Each rank is told to leave (nbddp's own synchronisation, on the command pipes: never a collective on
        the user's group); they exit."""
        if run.gang.piped and not self.leave_sent:
            self.leave_sent = True
            run.gang.command(messages.Stop())

    def rank_failed(self, run) -> None:
        """Every rank is stopped at once, the failed one too: it waits for this (worker._held), so a peer in a
        collective with it is stopped by nbddp before its connections close."""
        run.sup.stop_all()

    def timed_out(self, run) -> None:
        run.sup.stop_all()

    def stranded(self, run):
        return run.sup.stop_all

    def interrupt(self, run, announced: bool) -> list[int]:
        """Jupyter's interrupt: where was each rank? Its stack, then stop; the ranks that ran the cell."""
        sup = run.sup
        asked = sup.request_stacks(then=sup.stop_all) if announced else []
        if not announced:
            sup.stop_all()
        sup.reap()  # a second interrupt kills at once
        return [r for r in asked if r not in run.replies]  # (one that answered waits only to leave)

    def interrupted(self, run, running: list[int], announced: bool) -> KeyboardInterrupt:
        states = {r: failure.was_at(tracebacks.main_thread(dump), run.relabel, "was not in the cell's code "
                                    "(starting up, or in nbddp's own frames)")
                  for r, dump in run.stacks.stacks().items()}
        fate = "nbddp stopped every rank" if announced else "nbddp stopped every rank as it started"
        return failure.interrupted(running, states, str(run.gang.run_dir.path), fate)

    def check_alive(self, run) -> None:
        pass

    def exits(self, run) -> list:
        return [p.exit for p in run.sup.procs]

    def with_fate(self, run, err: RankFailure, recover: bool) -> RankFailure:
        return err  # nothing is left to say: the ranks ended with the cell

    def end(self, run) -> None:
        run.gang.close()  # every rank has exited (or was stopped and reaped): the gang ends with the cell


class PoolRules(CellRules):
    """A pool's cell: its ranks answer it and live on; after an interrupt or a failure, ``Recovery`` decides
    whether the pool does."""

    timeout_fate = "their cells were interrupted"

    def __init__(self):
        self.recovery: Recovery | None = None
        self.interrupted_at: float | None = None  # when the ranks still running were interrupted
        self.gave_up = False  # not all answered within STUCK_S of it (HEALTH_S across machines, or where all heard
        # it), or were seen blocked
        self.survived = True  # whether the pool lives on after an interrupt
        self.lost = False  # a rank died during the cell

    def listeners(self, run) -> list:
        self.recovery = Recovery(run.gang, run.ranks, run.replies, run.wait_for)
        return [self.recovery]

    def prompts_refused(self, run) -> str | None:
        if self.told_to_stop():
            return ("the cell was stopped (a rank failed, --timeout, or an interrupt): its ranks' prompts are no "
                    "longer asked")
        return None

    def told_to_stop(self) -> bool:
        """The ranks still running the cell were interrupted (a failed peer, --timeout, an interrupt)."""
        return self.interrupted_at is not None

    def over(self, run) -> bool:
        if self.lost and run.sup is not None:  # a pool that mends itself: once every live rank answered
            live = {p.rank for p in run.sup.live()}
            return all(r in run.replies for r in run.ranks if r in live) or self.gave_up
        return (not run.gang.alive or set(run.replies) >= set(run.ranks) or bool(run.probe.stranded)
                or self.gave_up)

    def all_answered(self, run) -> None:
        pass  # the ranks wait for the next cell

    def rank_failed(self, run) -> None:
        """The others are interrupted (they would wait for it in their next collective) after PEER_GRACE_S, or
        once every one still in the cell is seen blocked (grace.py): waiting for it already."""
        self._interrupt_soon(run)

    def rank_lost(self, run) -> None:
        """The survivors still in the cell are interrupted after PEER_GRACE_S, or once all are blocked (a
        collective with the lost rank fails on its own as its connections close); the cell is over once they
        answered."""
        if run.gang.on_loss is not None and not self.lost:  # (a pool's gang: its --on-loss, even end)
            self.lost = True
            self._interrupt_soon(run)

    def _interrupt_soon(self, run) -> None:
        Grace(run, time.monotonic() + timeline.PEER_GRACE_S, lambda: self.interrupt_running(run))

    def timed_out(self, run) -> None:
        self.interrupt_running(run)

    def stranded(self, run):
        return None  # the cell is over (``over``); the rank is freed by a fresh group as it concludes

    def interrupt_running(self, run) -> None:
        """KeyboardInterrupt into every rank still running the cell (SIGUSR2); past STUCK_S (HEALTH_S across
        machines), or once all who have not answered are seen blocked with no ``Heard`` from them (grace.py: their
        handler never ran), the cell is over, and they are freed by a fresh group (Recovery). Ranks that all
        heard it (back in Python, cleaning up) are given until HEALTH_S to answer."""
        if self.interrupted_at is not None or run.gang.sup is None:
            return
        self.interrupted_at = time.monotonic()
        for p in run.sup.live():
            if p.rank in run.ranks and p.rank not in run.replies:
                p.signal(INTERRUPT, group=False)
                if self.recovery is not None:
                    self.recovery.interrupted.append(p.rank)
        within = timeline.HEALTH_S if run.gang.spans_machines else timeline.STUCK_S  # (read now: one home)
        heard = self.recovery.heard if self.recovery is not None else set()
        Grace(run, self.interrupted_at + within, lambda: self._give_up(run, heard), back_in_python=heard)

    def _give_up(self, run, heard: set) -> None:
        """The ranks yet to answer are taken as held in a collective, unless every one of them heard the
        interrupt: those are given until HEALTH_S after it."""
        live = {p.rank for p in run.sup.live()}
        waiting = [r for r in run.ranks if r not in run.replies and r in live]
        later = self.interrupted_at + timeline.HEALTH_S
        if waiting and all(r in heard for r in waiting) and time.monotonic() < later:
            run.at(later, lambda: self._give_up(run, heard))
            return
        self.gave_up = True

    def interrupt(self, run, announced: bool) -> list[int]:
        running = [r for r in run.ranks if r not in run.replies]
        self.interrupt_running(run)
        try:
            run.wait(None)
        except KeyboardInterrupt:  # a second interrupt tears the pool down
            run.gang.close("torn down by a second interrupt")
            self.survived = False
            return running
        run.quiet()
        self.survived = self.recovery.recover()
        return running

    def interrupted(self, run, running: list[int], announced: bool) -> KeyboardInterrupt:
        states = failure.reply_states(running, run.replies, run.relabel)
        fate = failure.interrupt_fate(self.survived, self.recovery.regrouped, self.recovery.rebuilt)
        return failure.interrupted(running, states, str(run.gang.run_dir.path), fate)

    def check_alive(self, run) -> None:
        """A rank died: the cell fails saying so, and the pool mends itself (``--on-loss heal|shrink``) or
        ends with it."""
        gang = run.gang
        if gang.alive:
            return
        dead = [p.exit for p in gang.sup.procs if p.exit is not None]
        err = failure.rank_failed(dead, run.relabel, str(gang.run_dir.path)) if failure.root_cause(dead) else None
        if gang.on_loss is not None:  # a pool's gang: mended or ended as its --on-loss says, and said
            fate = gang.mend()
        else:
            gang.close("a rank exited")
            fate = "The pool has ended and its ranks' state is gone: %ddp start to begin again."
        raise RankFailure((str(err) if err else "a rank of the pool exited") + "\n" + fate,
                          rank=err.rank if err else None, cause=err.cause if err else "exit")

    def exits(self, run) -> list:
        return [run.cell_exit(r) for r in run.ranks]

    def with_fate(self, run, err: RankFailure, recover: bool) -> RankFailure:
        """The failure with what became of the pool: its recovery first, when the ranks must be brought back
        (``recover``); a cell that failed on every rank, each of them answering, leaves the pool as it was."""
        survived = self.recovery.recover() if recover else True
        fate = failure.pool_fate(survived, self.recovery.regrouped, self.recovery.gang.old_group or (),
                                 self.recovery.rebuilt)
        return RankFailure(f"{err}\n{fate}", rank=err.rank, cause=err.cause, stacks=err.stacks)

    def end(self, run) -> None:
        pass


class InBackground:
    """A kind's rules run on the background thread (``%%ddp --bg``): ``on_start(gang)`` once the ranks have the
    cell (background.Job: the notebook goes on); no prompt can be asked (its request has ended)."""

    def __init__(self, on_start):
        super().__init__()
        self.on_start = on_start

    def started(self, run) -> None:
        self.on_start(run.gang)

    def prompts_refused(self, run) -> str | None:
        return ("a background cell (%%ddp --bg) cannot ask the notebook for input: its request has ended. Run the "
                "cell without --bg to answer input() or pdb.")


class BackgroundOneShotRules(InBackground, OneShotRules):
    """A one-shot cell in the background."""


class BackgroundPoolRules(InBackground, PoolRules):
    """A pool's cell in the background."""


def for_cell(gang, on_start=None) -> CellRules:
    """The rules of a cell on ``gang``: a pool's or a one-shot cell's, in the background with ``on_start``."""
    if on_start is not None:
        return BackgroundPoolRules(on_start) if gang.persistent else BackgroundOneShotRules(on_start)
    return PoolRules() if gang.persistent else OneShotRules()
