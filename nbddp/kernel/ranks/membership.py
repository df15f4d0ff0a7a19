"""Who a gang's ranks are, and the process group they make: one authority changes it (torchft's ``Manager`` is the
model: the quorum changed once, in one place, and the group configured from it).

``Membership`` owns the process group's generation, rank -> process (the supervisor's ``RankProc``s and their
numbers), the world size and the placement (a device per rank: the plan's ``device_ids``; on a pool across nodes,
each rank's node). Its moves:

- ``next_generation``: a fresh group (a stuck collective freed: recovery.py; lost ranks' replacements joining the
  survivors: orchestrate.py), once per move however many ranks it takes;
- ``forget``: ranks that ended, no longer the supervisor's (their successors, forked next, take their numbers);
- ``renumber``: the ranks that stay, renumbered in a fresh group (a shrink, a resize to fewer);
- ``grow``: ranks added in a fresh group (a resize to more);
- ``place``: the node ranks run on (a pool across Ray nodes).

A renumbering or a growth is published once, as one ``supervisor.Moved`` on the supervisor's bus, and whoever
keeps a table per rank follows it (``on_Moved``): the rank logs (``RankLogs``), the gang (its command pipes, its
ready ranks, its specs; a cluster pool's gang: its streams' remote ranks, the values owed), the pool's dashboard
(``PoolView``). Another node's agent has no membership of its own (the kernel's decides): it renumbers its
supervisor's ranks with ``move_procs``, then its own tables, in one place (agent.py's ``_moved``).

No other module assigns the supervisor's ``procs``, a rank process's ``rank``, the generation or a rank's node
(tests/unit/test_house_rules.py).
"""
from __future__ import annotations

import dataclasses

from ...errors import UsageError
from .. import devices
from .supervisor import Moved


class Membership:
    def __init__(self, sup, plan, generation: int = 0):
        self.sup, self.plan = sup, plan  # plan: its device_ids, one per rank, say where each rank is
        # of the process group: made anew when ranks move or a rank is stuck in a collective
        self.generation = generation
        self.nodes: dict[int, str] = {}  # rank -> its node's name (a pool across Ray nodes; none on one machine)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def room(self, n: int) -> tuple:
        """Devices for ``n`` more ranks (``%ddp resize``), found before anything changes: CPU ranks need none;
        GPUs not used by the pool yet, else UsageError."""
        plan = self.plan
        if plan.accelerator != "cuda":
            return (None,) * n
        free = [d for d in devices.plan(-1, "cuda", plan.backend).device_ids if d not in plan.device_ids]
        if len(free) < n:
            raise UsageError(f"%ddp resize: {n} more GPU(s) wanted, {len(free)} not used by the pool. Nothing changed.")
        return tuple(free[:n])

    def next_generation(self) -> int:
        """A fresh process group: its generation, which the ranks join (``Regroup``, a replacement's spec)."""
        self.generation += 1
        return self.generation

    def place(self, ranks, node: str) -> None:
        """The ranks of ``ranks`` run on ``node`` (a pool across Ray nodes: started there, or a lost node's ranks
        started anew there)."""
        self.nodes.update(dict.fromkeys(ranks, node))

    def forget(self, ranks) -> None:
        """The ranks of ``ranks`` that ended (their descriptors closed as they were reaped) are no longer the
        supervisor's: their successors are awaited under their numbers."""
        self.sup.procs = [p for p in self.sup.procs if p.rank not in ranks or p.exit is None]

    def renumber(self, moves: dict) -> Moved:
        """The ranks of ``moves`` stay (old rank -> new, in order), in a fresh group; those that ended, and every
        rank not in ``moves``, are forgotten. Published."""
        self.next_generation()
        move_procs(self.sup, moves)
        self.plan = dataclasses.replace(self.plan, device_ids=tuple(self.plan.device_ids[r] for r in sorted(moves)))
        self.nodes = {moves[r]: n for r, n in self.nodes.items() if r in moves}
        return self._publish(moves, ())

    def grow(self, device_ids: tuple) -> range:
        """One rank added on each of ``device_ids`` (numbered from the world size now), in a fresh group, the others
        keeping their numbers. Published; the new ranks (forked next: none is yet)."""
        self.next_generation()
        old = self.world_size
        self.plan = dataclasses.replace(self.plan, device_ids=tuple(self.plan.device_ids) + tuple(device_ids))
        self._publish({r: r for r in range(old)}, tuple(range(old, self.world_size)))
        return range(old, self.world_size)

    def _publish(self, moves: dict, added: tuple) -> Moved:
        moved = Moved(self.generation, dict(moves), self.world_size, tuple(self.plan.device_ids), added)
        self.sup.bus.publish(moved)
        return moved


def move_procs(sup, moves: dict) -> None:
    """``sup``'s rank processes renumbered (old rank -> new): those that ended, and every rank not in ``moves``,
    forgotten. The one place a rank process's number changes (a gang's ``Membership``; another node's agent)."""
    sup.procs = [p for p in sup.procs if p.rank in moves and p.exit is None]
    for proc in sup.procs:
        proc.rank = moves[proc.rank]
