"""A grace that ends as soon as waiting longer cannot help: the time a pool's cell gives the ranks still running
it, after a peer failed (``PEER_GRACE_S``: to fail on their own, each with its own error) or after an
interrupt (``STUCK_S``: to answer it). Once every one of them is seen blocked in native code (hw/procwait.py:
asleep on a futex, running nothing, since the look before), they wait in a collective that cannot finish, and
the grace would end the same way, only later. The ranks are looked at every ``POLL_S`` (``RankProc.look``); a
rank on another node by its agent, whose answer comes on the node's stream (a look behind: ``RemoteProc.look``).
"""
from __future__ import annotations

import time

from ...hw import procwait

POLL_S = 0.1  # how often the ranks are looked at


class Grace:
    """``action()`` once: at ``end``, or at the first look that finds every rank still running ``run``'s cell
    (and alive) blocked since the look before. On the cell's schedule (``run.at``): cancelled with it."""

    def __init__(self, run, end: float, action):
        self.run, self.end, self.action = run, end, action
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
        self.run.at(min(now + POLL_S, self.end), self._look)

    def _all_blocked(self) -> bool:
        run = self.run
        if run.sup is None:
            return False
        looks = {p.rank: p.look() for p in run.sup.live() if p.rank in run.ranks and p.rank not in run.replies}
        held = bool(looks) and all(procwait.blocked(self.looks.get(rank), now) for rank, now in looks.items())
        self.looks = looks
        return held
