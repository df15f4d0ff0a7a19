"""The rules of each kind of cell, one declared interface (rules.CellRules), without a kernel: every kind an
explicit class, what for_cell picks, the one rule for prompts, and a refused prompt always answered."""
import inspect
import os

import pytest

from nbddp.kernel.cells import rules
from nbddp.kernel.cells.prompts import Prompts
from nbddp.wire import messages

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)


class FakeGang:
    def __init__(self, persistent):
        self.persistent = persistent
        self.sent = []

    def command(self, cmd, ranks=None):
        self.sent.append((cmd, ranks))


KINDS = (rules.OneShotRules, rules.PoolRules, rules.BackgroundOneShotRules, rules.BackgroundPoolRules)


def test_every_kind_is_an_explicit_class_of_the_one_interface():
    with pytest.raises(TypeError):
        rules.CellRules()  # abstract: a kind must say every rule
    abstract = {n for n, v in vars(rules.CellRules).items() if getattr(v, "__isabstractmethod__", False)}
    assert {"prompts_refused", "over", "interrupt", "with_fate", "end"} <= abstract
    for kind in KINDS:
        assert issubclass(kind, rules.CellRules) and not inspect.isabstract(kind), kind
        assert "__getattr__" not in {n for c in kind.__mro__ for n in vars(c)}, kind  # nothing handed on unseen
        assert isinstance(kind.timeout_fate, str)


@pytest.mark.parametrize("persistent, on_start, kind", [
    (False, None, rules.OneShotRules), (True, None, rules.PoolRules),
    (False, print, rules.BackgroundOneShotRules), (True, print, rules.BackgroundPoolRules)])
def test_for_cell_picks_the_kind(persistent, on_start, kind):
    assert type(rules.for_cell(FakeGang(persistent), on_start)) is kind


def test_one_rule_for_prompts():
    run = object()
    assert rules.OneShotRules().prompts_refused(run) is None
    pool = rules.PoolRules()
    assert pool.prompts_refused(run) is None
    pool.interrupted_at = 1.0  # its ranks were told to stop
    assert "no longer asked" in pool.prompts_refused(run)
    for kind in (rules.BackgroundOneShotRules, rules.BackgroundPoolRules):
        assert "cannot ask the notebook for input" in kind(print).prompts_refused(run)


def test_a_background_cells_rules_start_it_and_are_their_kinds_otherwise():
    started = []
    bg = rules.BackgroundPoolRules(started.append)

    class Run:
        gang = "the gang"

    bg.started(Run())
    assert started == ["the gang"]
    assert bg.timeout_fate == rules.PoolRules.timeout_fate and bg.told_to_stop() is False


def test_a_refused_prompt_is_answered_with_the_error_never_dropped():
    gang = FakeGang(True)
    prompts = Prompts(gang)

    class Event:
        def __init__(self, rank, record):
            self.rank, self.record = rank, record

    for rank, rid in ((0, 7), (1, 8)):
        prompts.on_Message(Event(rank, messages.InputRequest(rid, "x? ", False)))
    prompts.refuse("the cell was stopped")
    assert prompts.due() is None
    answered = {(cmd.id, ranks[0]) for cmd, ranks in gang.sent}
    assert answered == {(7, 0), (8, 1)}
    assert all(cmd.error == "StdinNotImplementedError" and cmd.message == "the cell was stopped"
               for cmd, _ in gang.sent)


class InterruptedCell:
    """A stand-in engine.CellRun of a pool: ranks 0-1 still running, never seen blocked; its schedule run by hand."""

    def __init__(self, spans_machines=False):
        from types import SimpleNamespace

        self.ranks, self.replies, self.timers, self.signalled = (0, 1), {}, [], []
        procs = [SimpleNamespace(rank=r, look=lambda: None, signal=lambda sig, group, r=r: self.signalled.append(r))
                 for r in (0, 1)]
        self.sup = SimpleNamespace(live=lambda: procs)
        self.gang = SimpleNamespace(sup=self.sup, spans_machines=spans_machines, alive=True)
        self.probe = SimpleNamespace(stranded=[])

    def at(self, when, action):
        self.timers.append((when, action))

    def until(self, clock, t):
        """The schedule run up to time ``t``."""
        while due := sorted((w, i) for i, (w, _) in enumerate(self.timers) if w <= t):
            when, i = due[0]
            clock[0] = when
            self.timers.pop(i)[1]()
        clock[0] = t


@pytest.mark.parametrize("heard, spans, gives_up_at", [
    ({0, 1}, False, "HEALTH_S"),  # both back in Python, cleaning up: until HEALTH_S
    ({0}, False, "STUCK_S"),  # rank 1's handler never ran: held in native code, STUCK_S
    (set(), True, "HEALTH_S"),  # across machines: HEALTH_S in any case
])
def test_an_interrupted_pools_ranks_are_given_up_on_at_stuck_s_or_health_s_once_all_heard(heard, spans, gives_up_at,
                                                                                          monkeypatch):
    from types import SimpleNamespace

    from nbddp import timeline

    clock = [100.0]
    monkeypatch.setattr(rules.time, "monotonic", lambda: clock[0])  # (the one clock rules.py and grace.py read)
    cell, pool = InterruptedCell(spans), rules.PoolRules()
    pool.recovery = SimpleNamespace(heard=heard, interrupted=[])
    pool.interrupt_running(cell)
    assert cell.signalled == [0, 1] and pool.recovery.interrupted == [0, 1]
    at = 100.0 + {"STUCK_S": timeline.STUCK_S, "HEALTH_S": timeline.HEALTH_S}[gives_up_at]
    cell.until(clock, at - 0.01)
    assert not pool.gave_up and not pool.over(cell)
    cell.until(clock, at)
    assert pool.gave_up and pool.over(cell)


def test_a_rank_already_dead_when_every_rank_is_stopped_is_not_said_stopped_by_nbddp():
    """A one-shot cell stops every rank at the first report (OneShotRules.rank_failed): a peer killed meanwhile whose
    end the kernel had not read yet is not "stopped by nbddp" (its SIGKILL stays the cause, the report "likely a
    consequence"). Each rank's life pipe stands in for its pidfd: readable once it ended."""
    from nbddp.kernel.ranks.supervisor import RankProc, Supervisor

    nowhere = 2**22 + 7  # above any pid_max: signals to it find no process
    (alive_r, alive_w), (dead_r, dead_w) = os.pipe(), os.pipe()
    os.close(dead_w)  # rank 1 ended: its life pipe's write end closed with it
    sup = Supervisor()
    try:
        sup.procs = [RankProc(0, nowhere, alive_r, pidfd=False), RankProc(1, nowhere + 1, dead_r, pidfd=False)]
        assert [p.ended_unread() for p in sup.procs] == [False, True]
        sup.stop_all()
        assert [p.stop_sent for p in sup.procs] == [True, False]
    finally:
        for fd in (alive_r, alive_w, dead_r):
            os.close(fd)
