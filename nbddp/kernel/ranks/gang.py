"""A gang: the ranks started from the kernel with one job, supervised until they are gone.

A one-shot cell and a pool both have one; what differs is named here and nowhere else:
- a one-shot cell's gang is started *for* the cell (its ranks see the notebook as it is now, in-place
  changes included), gets the cell with the fork and ends with it (``persistent=False``);
- a pool's gang (``persistent=True``) gets a command pipe per rank, lives across cells, and keeps a
  dashboard (its ``view``) subscribed for its whole life.
Its run directory (0700), rank logs (0600), supervisor and command pipes live and die together.
"""
from __future__ import annotations

import os
import time

from ...wire import framing, messages
from . import failure, groupstore, rendezvous, starters
from .logs import RankLogs
from .supervisor import Supervisor

STOP_S = 5.0  # a pool's ranks leave the group and exit within this after Stop, or are killed


class Gang:
    def __init__(self, config, plan, *, persistent: bool, view_for=None):
        self.config, self.plan, self.persistent = config, plan, persistent
        self.world_size = plan.world_size
        self.run_dir = rendezvous.new_run_dir()
        self.logs = RankLogs({r: str(self.run_dir.log(r)) for r in range(plan.world_size)})
        # a pool's dashboard (poolview.PoolView, from view_for(plan, run_dir)): subscribed for the gang's life
        self.view = view_for(plan, self.run_dir) if view_for else None
        self.sup: Supervisor | None = Supervisor(self.lifelong())
        self.ready: set[int] = set()
        self.started = False
        self.generation = 0  # of its process group: a pool's is made anew when a rank is stuck in a collective
        self.old_group: tuple | None = None  # once its group was made anew: what the ranks had bound to the old one
        self.why: str | None = None  # how it ended, once closed ("stopped", "rank 1 exited: ...")
        self._cmd: dict[int, int] = {}
        self._starter = None
        self.local = None  # forked ranks: the kernel's store and the thread serving their store pipes

    def lifelong(self) -> list:
        """The subscribers every cell's bus starts with."""
        return [self.logs, self, *([self.view] if self.view is not None else [])]

    def on_Message(self, event) -> None:
        if isinstance(event.record, messages.Ready):
            self.ready.add(event.rank)

    # -- life ----------------------------------------------------------------------------------------
    @property
    def piped(self) -> bool:
        """Its ranks have command pipes (every forked gang, from the kernel or the forkserver; spawned ranks
        have none)."""
        return starters.starter_for(self.plan).command_pipes

    def start(self, job_for, deadline: float | None = None) -> None:
        """One rank per planned device, running ``job_for(command pipes)``: a pool's commands, a one-shot
        cell's ``Stop``. Past ``deadline`` no more are forked."""
        pipes = {r: os.pipe() for r in range(self.world_size)} if self.piped else {}
        self._cmd = {r: w for r, (_, w) in pipes.items()}
        self._starter = starters.starter_for(self.plan)(self.run_dir)
        self.started = True
        prepare = None
        if self.piped:  # the process group meets on the kernel's store, over pipes
            self.local = groupstore.LocalStores(groupstore.Store())
            prepare = starters.store_pipes(self.local)
        try:
            self._starter.ready(self.config)
            starters.fork_ranks(self.sup, self._starter, job_for(pipes), self.config, self.plan, self.run_dir,
                                deadline, prepare)
        finally:
            for read, _ in pipes.values():
                os.close(read)
            if self.local is not None:
                self.local.start()

    def node_of(self, rank: int) -> str:
        """The node a rank runs on, as failures name it: none on one machine (a cluster pool's gang says)."""
        return ""

    @property
    def alive(self) -> bool:
        return self.sup is not None and len(self.sup.live()) == self.world_size

    def command(self, cmd, ranks=None) -> None:
        """One framed command on every live rank's pipe (or those of ``ranks``)."""
        frame = framing.encode(cmd)
        for fd in (self._cmd.values() if ranks is None else [self._cmd[r] for r in ranks if r in self._cmd]):
            try:
                framing.write_all(fd, frame)
            except BrokenPipeError:
                pass  # that rank is gone; the supervisor reports how

    def stop(self) -> None:
        """A pool's end: every rank leaves the group and exits; SIGTERM/SIGKILL whoever does not in STOP_S."""
        if self.sup is None:
            return
        end = time.monotonic() + STOP_S
        try:
            self.command(messages.Stop())
            self.sup.end_cell()
            self.sup.wait(None, until=lambda: time.monotonic() >= end, wake_at=end)
        finally:
            self.close("stopped")

    def close(self, why: str = "torn down") -> None:
        """Stop whatever still runs, reap it, and release everything the gang holds (once). ``why``: how it
        ended, as the pool's view and its next cell say it (a rank's own death is named instead)."""
        if self.sup is None:
            return
        dead = [p.exit for p in self.sup.procs if p.exit is not None and not p.exit.stopped]
        cause = failure.root_cause(dead) or (dead[0] if dead else None)  # not a peer that died of its loss
        self.why = why if why == "stopped" or cause is None else f"rank {cause.rank}{cause.where} exited ({cause.describe()})"
        if self.view is not None:
            self.view.finish(self.why if why == "stopped" else f"ended: {self.why}")
        sup, self.sup = self.sup, None
        sup.stop_all()
        sup.reap()
        sup.close()
        for fd in self._cmd.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._cmd = {}
        if self.local is not None:
            self.local.close()  # (once: a cluster gang closes it too)
        self.logs.close()
        self.run_dir.release_store()
        if self._starter is not None:
            self._starter.cleanup()
