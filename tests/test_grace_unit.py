"""kernel/cells/grace.py on a stand-in cell: the grace ends at the first look that finds every rank still in the
cell blocked since the look before, once; never for a rank that answered, one that computes, or one whose
interrupt handler ran (``Heard``); at its end in any case."""
from types import SimpleNamespace

import pytest

from nbddp.hw.procwait import Look
from nbddp.kernel.cells import grace

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)

WAITING = Look(on_futex=True, main_ns=5_000_000, ticks=7, at=0.0)


def _later(look: Look, s: float, ns: int = 0, ticks: int = 0) -> Look:
    return Look(look.on_futex, look.main_ns + ns, look.ticks + ticks, look.at + s)


class Cell:
    """A stand-in engine.CellRun: ranks 0-1, each looked at as ``shows[rank]`` says (a list, one per look)."""

    def __init__(self, shows: dict, replies=None):
        self.ranks, self.replies, self.timers = (0, 1), replies or {}, []
        self.shows = shows
        procs = [SimpleNamespace(rank=r, look=lambda r=r: self.shows[r].pop(0)) for r in (0, 1)]
        self.sup = SimpleNamespace(live=lambda: procs)

    def at(self, when, action):
        self.timers.append((when, action))

    def next_look(self):
        _, action = self.timers.pop(0)
        action()


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(grace.time, "monotonic", lambda: now[0])
    return now


def test_every_rank_blocked_between_two_looks_ends_the_grace_once(clock):
    fired = []
    cell = Cell({0: [WAITING, _later(WAITING, 0.1)], 1: [WAITING, _later(WAITING, 0.1)]})
    g = grace.Grace(cell, clock[0] + 1.0, lambda: fired.append(clock[0]))
    assert not fired, "one look tells nothing"
    clock[0] += 0.1
    cell.next_look()
    assert fired == [100.1] and not cell.timers and g.over


def test_a_rank_that_answered_is_not_waited_for(clock):
    fired = []
    cell = Cell({0: [WAITING, _later(WAITING, 0.1)], 1: []}, replies={1: "its answer"})
    grace.Grace(cell, clock[0] + 1.0, lambda: fired.append(1))
    clock[0] += 0.1
    cell.next_look()
    assert fired == [1]


@pytest.mark.parametrize("busy", [dict(ns=2_000_000), dict(ticks=3)], ids=["main-thread-ran", "others-ran"])
def test_a_rank_that_ran_between_the_looks_keeps_the_whole_grace(clock, busy):
    fired = []
    cell = Cell({0: [WAITING, _later(WAITING, 0.1)], 1: [WAITING, _later(WAITING, 0.1, **busy)]})
    grace.Grace(cell, clock[0] + 0.15, lambda: fired.append(clock[0]))
    clock[0] += 0.1
    cell.next_look()
    assert not fired and cell.timers[0][0] == pytest.approx(100.15), "the next look at the grace's end"
    clock[0] = 100.15
    cell.next_look()
    assert fired == [100.15]


def test_a_rank_whose_interrupt_handler_ran_keeps_the_whole_grace(clock):
    fired, heard = [], set()
    cell = Cell({r: [WAITING, _later(WAITING, 0.1), _later(WAITING, 0.2)] for r in (0, 1)})
    grace.Grace(cell, clock[0] + 1.0, lambda: fired.append(1), back_in_python=heard)
    heard.add(1)  # (its Heard came meanwhile: a live set)
    clock[0] += 0.1
    cell.next_look()
    assert not fired


def test_looks_too_close_together_or_missing_tell_nothing(clock):
    fired = []
    cell = Cell({0: [WAITING, _later(WAITING, 0.01)], 1: [None, None]})
    grace.Grace(cell, clock[0] + 1.0, lambda: fired.append(1))
    clock[0] += 0.1
    cell.next_look()
    assert not fired
