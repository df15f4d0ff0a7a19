"""A grace that ends as soon as waiting longer cannot help: the time a pool's cell gives the ranks still running
it, after a peer failed (``PEER_GRACE_S``: to fail on their own, each with its own error) or after an
interrupt (``STUCK_S``: to answer it).

After a peer failed, once every one of them is seen waiting (hw/procwait.py: asleep on a futex, neither it nor
its threads nor its children using a CPU, since the look before), they wait for that peer in a collective (or
for nothing that computes), and are interrupted at once. After the interrupt, one seen so whose Python handler
never ran (no ``Heard`` from it) is held in native code: once that is so of every rank yet to answer, they are
freed by a fresh group at once; a rank that heard the interrupt gets the whole grace to answer, however its
cleanup waits (and, where all yet to answer heard it, until ``HEALTH_S``: rules.PoolRules._give_up).
The ranks are looked at every ``POLL_S`` (``RankProc.look``; a rank on another node by its
agent, whose answer comes on the node's stream, a look behind: ``RemoteProc.look``).
"""
from __future__ import annotations

import time

from ... import timeline
from ...hw import procwait


class Grace:
    """``action()`` once: at ``end``, or at the first look that finds every rank still running ``run``'s cell
    (and alive) blocked since the look before, none of them in ``back_in_python`` (a live set: the ranks whose
    handler of the interrupt ran). On the cell's schedule (``run.at``): cancelled with it."""

    def __init__(self, run, end: float, action, back_in_python=frozenset()):
        self.run, self.end, self.action, self.back_in_python = run, end, action, back_in_python
        self.looks: dict[int, procwait.Look | None] = {}  # rank -> how it was at the last look
        self.over = False
        self._look()

    def _look(self) -> None:
        if self.over:
            return
        now = time.monotonic()
        if now >= self.end or self._all_blocked():
            self.over = True
            self.action()
            return
        self.run.at(min(now + timeline.POLL_S, self.end), self._look)

    def _all_blocked(self) -> bool:
        run = self.run
        if run.sup is None:
            return False
        waiting = [p for p in run.sup.live() if p.rank in run.ranks and p.rank not in run.replies]
        looks = {p.rank: p.look() for p in waiting}
        held = bool(looks) and all(procwait.blocked(self.looks.get(rank), now) and rank not in self.back_in_python
                                   for rank, now in looks.items())
        self.looks = looks
        return held
