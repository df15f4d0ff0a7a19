"""A pool after an interrupt or a failed cell: does it live on? (the recovery policy)

Every rank must answer the cell (within ``STUCK_S`` of the interrupt, unless seen blocked in native code: grace.py;
within ``HEALTH_S`` where every rank yet to answer heard it: rules.PoolRules._give_up)
and pass a barrier (``HealthCheck``) within ``HEALTH_S``. Where ranks still wait in a collective (no answer by
then), the interrupt cannot reach them: on gloo the others leave the process group, which frees them ("Connection
closed by peer"); on NCCL the stuck rank aborts its own communicators a second after the interrupt
(rank/ncclabort.py). Every rank then makes a fresh group (``Regroup``) within ``REGROUP_S``; the DDP models in the
ranks' namespaces are made anew on it (kernel/healing/orchestrate.py), and anything else bound to the old group is
named so the user can make it again. A pool whose rank never answers is torn down. An interrupt during any of this
tears the pool down too: it can no longer be vouched for.
"""
from __future__ import annotations

import time

from ... import timeline
from ...wire import messages
from ..healing import orchestrate, steps
from ..ranks import starters


class Recovery:
    """For one pool cell on ``ranks``: a listener of the cell (the ranks' ``Healthy`` answers), and
    ``recover()``. ``replies`` is the cell's (rank -> its answer); ``wait(until, wake_at)`` runs the
    supervisor's loop as the cell does (prompts, the relay's releases)."""

    def __init__(self, gang, ranks, replies: dict, wait):
        self.gang, self.ranks, self.replies, self.wait = gang, ranks, replies, wait
        self.healthy: set[int] = set()
        self.regrouped: list[int] = []  # ranks freed from a collective by a fresh process group
        self.old_group_users: set[str] = set()  # what the ranks had bound to the old group (their Healthy answers)
        self.rebuilt: list = []  # (name, kind): what was made anew on the fresh group (DDP models, meshes)
        self.interrupted: list[int] = []  # ranks sent the interrupt (on NCCL, one may have aborted its group)
        self.heard: set[int] = set()  # ranks whose Python handler of the interrupt ran (``Heard``): not held

    def on_Message(self, event) -> None:
        if isinstance(event.record, messages.Heard):
            self.heard.add(event.rank)
        if isinstance(event.record, messages.Healthy):
            self.healthy.add(event.rank)
            self.old_group_users.update(event.record.bound)

    def recover(self) -> bool:
        """True if the pool lives on (its ranks all answered and healthy, in the old group or a fresh one)."""
        gang = self.gang
        stuck = [r for r in self.ranks if r not in self.replies]
        if gang.alive and (stuck or self.interrupted and "nccl" in gang.plan.backend):  # (rank/ncclabort.py)
            if self._all_healthy(messages.Regroup(gang.next_generation()), timeline.REGROUP_S,
                                 "torn down by an interrupt while its process group was made anew"):
                # those freed from a collective: a rank only slow to answer (past STUCK_S) answers the interrupt
                self.regrouped = [r for r in stuck if not _interrupted(self.replies.get(r))] or stuck or sorted(
                    self.interrupted)
                try:  # the DDP models (meshes...) in the ranks' namespaces, made anew on the new group for the user
                    self.rebuilt = orchestrate.regrouped(gang)
                except steps.HealFailed as e:
                    gang.close(f"torn down: its DDP models could not be made anew on its new process group ({e})")
                    return False
                made = tuple(f"{name} ({kind}" for name, kind in self.rebuilt)
                gang.old_group = tuple(sorted(u for u in self.old_group_users if not u.startswith(made)))
                return True
            gang.close("torn down: its process group could not be made anew")
            return False
        if gang.alive and not stuck and self._all_healthy(messages.HealthCheck(), timeline.HEALTH_S,
                                                          "torn down by an interrupt during its health check"):
            return True
        gang.close("torn down: a rank did not come back from a collective after the cell failed or was "
                   "interrupted")
        return False

    def _all_healthy(self, cmd, within: float, interrupted: str) -> bool:
        """``cmd`` to every rank; True once each has answered the cell and then ``Healthy`` within
        ``within`` s. An interrupt meanwhile tears the pool down (``interrupted``: why)."""
        gang = self.gang
        self.healthy = set()
        end = time.monotonic() + within
        try:
            with starters.sigint_deferred():
                gang.command(cmd)
            self.wait(until=lambda: len(self.healthy) == gang.world_size and set(self.replies) >= set(self.ranks)
                      or not gang.alive or time.monotonic() >= end, wake_at=end)
        except KeyboardInterrupt:  # the pool cannot be vouched for
            gang.close(interrupted)
            return False
        return gang.alive and len(self.healthy) == gang.world_size


def _interrupted(answer) -> bool:
    """The rank answered the interrupt itself (a KeyboardInterrupt where its cell was): it was not held in a
    collective. One freed from a collective raises it too, but while the collective's own error is handled."""
    return (isinstance(answer, messages.Error) and answer.type == "KeyboardInterrupt"
            and "During handling of the above exception" not in answer.traceback)
