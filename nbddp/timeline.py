"""The failure timeline: every deadline that decides what becomes of a rank that failed, is lost or is stuck, and of
a node that went silent, in one place. Any part of the package may import it (as errors.py and units.py); each
module that keeps one of these deadlines reads it here, at the moment it is needed (``timeline.STUCK_S``), so
that a test or a benchmark that changes one changes it everywhere.

How they follow each other, for a pool's cell (a one-shot cell stops every rank at its first failure, at once):

- t0: a rank raises in a pool's cell, or its process ends (a lost rank, below): rules.PoolRules.rank_failed.
- t0 to t0 + PEER_GRACE_S: the others go on, to fail on their own, each with its own error (grace.Grace). They are
  looked at every POLL_S (two looks MIN_GAP_S apart at least); the grace ends at once when every rank still in the
  cell is blocked (procwait.blocked: waiting in a collective for the failed one).
- t1: the others still running are interrupted (SIGUSR2: a KeyboardInterrupt in their cell,
  rules.PoolRules.interrupt_running); a rank on NCCL still in that command ABORT_AFTER_S later aborts its
  communicators (ncclabort.InterruptWatch).
- t1 to t1 + STUCK_S: each answers the interrupt. One that said ``Heard`` (its handler ran: cleaning up) is given
  until t1 + HEALTH_S, as is every rank of a pool across machines (the signal goes through the node's agent); the
  wait ends at once (a Grace again) once every rank yet to answer is blocked and none of them heard.
- t2: ranks that did not answer wait in a collective: every rank makes a fresh process group (``Regroup``) within
  REGROUP_S, which frees them (recovery.Recovery).
- t2 to t2 + HEALTH_S: every rank passes a barrier (``HealthCheck``), or the pool is torn down (recovery.Recovery).

A rank *lost* (its process ended: the OOM killer, a signal, a segfault), in a pool whose ``--on-loss`` heals or
shrinks: the loss is seen at once (its pidfd); ranks that die with it within SETTLE_S are mended with it; the
survivors still in a cell are interrupted as above (PEER_GRACE_S, then STUCK_S / HEALTH_S); each mending step's
answers (a survey, an export of many GiB) come within STEP_S, a replacement is up and every rank in the new
group within JOIN_S, or the pool ends (kernel/healing/).

A rank left alone in a collective (every other rank answered the cell): asked for its stack ALONE_S after the last
answer, again every STILL_S; stranded in a collective no peer will join, the cell fails (kernel/cells/probe.py).

A one-shot cell's failed rank: it reports its error, then waits (HELD_S at most) for the kernel, which stops every
rank at once on that report (kernel/cells/rules.py OneShotRules): its peers are stopped by nbddp before its
connections close under them (rank/worker.py).

Ending ranks: a pool's ranks leave the group and exit within STOP_S of ``Stop`` (kernel/ranks/gang.py); a rank
told to end gets SIGTERM, then SIGKILL GRACE_S later, as torch.elastic does (kernel/ranks/supervisor.py).

A kept pool taken by a new kernel (kernel/taking.py): with no cell left running in them, its ranks answer the new
kernel's first call within TAKE_S, or the pool cannot be vouched for and ends, saying which rank was silent.

Across the nodes of a Ray cluster (nbddp/cluster/): each node's agent says something at least every BEAT_S; a node
whose stream is silent SILENT_S is lost with its ranks; a look at a node's ranks unanswered LOOK_LOST_S is asked
again; a lost node's bundle is moved by Ray within MOVED_S (else placed anew), its ranks started elsewhere if
there is room within MOVE_S; a node left with no rank ends its stream within EMPTIED_S.

The order these rely on is tested (tests/unit/test_timeline.py): a look is quicker than a grace, an agent beats
more often than a node is taken as lost, a rank's answer to the interrupt comes before the barrier's end.
"""
from __future__ import annotations

# -- a failed rank, in a pool's cell -----------------------------------------------------------------------------
PEER_GRACE_S = 1.0  # after a rank failed a cell, how long the others may go on before being interrupted
POLL_S = 0.1  # during a grace, how often the ranks still in the cell are looked at
MIN_GAP_S = 0.05  # two looks closer than this tell nothing (a node's agent may answer two asks at once)
STUCK_S = 1.0  # an interrupted rank that has not answered within this is taken to wait in a collective
HEALTH_S = 3.0  # ... one that heard the interrupt (or across machines) within this; and the barrier after it
REGROUP_S = 10.0  # every rank in a fresh process group within this (a rank stuck elsewhere: torn down)
ABORT_AFTER_S = 1.0  # a rank on NCCL still in the interrupted command this long after: its communicators aborted

# -- a rank alone in a collective --------------------------------------------------------------------------------
ALONE_S = 2.0  # a rank still in the cell this long after every other rank answered: where is it?
STILL_S = 30.0  # ... and asked again every STILL_S: a stack that has not moved is shown in the cell

# -- a lost rank, healed ----------------------------------------------------------------------------------------
SETTLE_S = 0.2  # before mending, other ranks that die with the first are waited for this long
STEP_S = 120.0  # a mending step's answers (a survey of many GiB, an export) within this, or the pool ends
JOIN_S = 60.0  # a replacement up and every rank in the new group within this

# -- a one-shot cell's failed rank ------------------------------------------------------------------------------
HELD_S = 5.0  # a rank that failed a one-shot cell waits this long at most for the kernel to stop every rank

# -- ranks ended -------------------------------------------------------------------------------------------------
STOP_S = 5.0  # a pool's ranks leave the group and exit within this after Stop, or are killed
GRACE_S = 3.0  # SIGTERM -> SIGKILL, like torch.elastic

# -- a kept pool taken -------------------------------------------------------------------------------------------
TAKE_S = 30.0  # idle ranks answer a new kernel's first call within this, or the pool ends

# -- a node of a Ray cluster -------------------------------------------------------------------------------------
BEAT_S = 1.0  # the longest a node's stream stays silent: its agent sends an empty batch then
SILENT_S = 5.0  # a node whose stream said nothing (not even its beat) this long is lost
LOOK_LOST_S = 1.0  # a look at a node's ranks unanswered this long is asked again
MOVED_S = 2.0  # a dead node's bundle moved by Ray by then, or placed anew on a node of its own
MOVE_S = 10.0  # a lost node's ranks are started on another node if Ray moves its bundle there by then
EMPTIED_S = 5.0  # a node left with no rank: its agent's stream for the pool ends within this
