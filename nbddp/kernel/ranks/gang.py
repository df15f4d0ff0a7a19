"""A gang: the ranks started from the kernel with one job, supervised until they are gone.

A one-shot cell and a pool both have one; what differs is named here and nowhere else:
- a one-shot cell's gang is started *for* the cell (its ranks see the notebook as it is now, in-place
  changes included), gets the cell with the fork and ends with it (``persistent=False``);
- a pool's gang (``persistent=True``) gets a command pipe per rank, lives across cells, and keeps a
  dashboard (its ``view``) subscribed for its whole life.
Its run directory (0700), rank logs (0600), supervisor and command pipes live and die together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time

from ... import timeline
from ...hw import driverwatch
from ...wire import framing, messages
from ..debugger import rankdebug
from . import failure, groupstore, keeping, rendezvous, starters
from .logs import RankLogs
from .membership import Membership
from .supervisor import RankProc, Started, Supervisor


class ReplaceFailed(RuntimeError):
    """No replacement could be started for a lost rank; the message says why (a pool across nodes: its node).
    ``started``: whether a process may have started all the same (False: none did; the pool may go on without)."""

    def __init__(self, why: str, started: bool = True):
        super().__init__(why)
        self.started = started


class Gang:
    spans_machines = False  # its ranks all on this machine (a cluster pool's gang: across nodes)

    def __init__(self, config, plan, *, persistent: bool, view_for=None, run_dir=None, generation: int = 0):
        self.config, self.persistent = config, persistent
        self.run_dir = run_dir or rendezvous.new_run_dir()  # (a kept pool taken: its own)
        self.logs = RankLogs(self.run_dir, range(plan.world_size))
        # a pool's dashboard (poolview.PoolView, from view_for(plan, run_dir)): subscribed for the gang's life
        self.view = view_for(plan, self.run_dir) if view_for else None
        self.sup: Supervisor | None = Supervisor(self.lifelong())
        self.members = Membership(self.sup, plan, generation)  # its ranks, their places and their group's generation
        self.keeper: keeping.KeeperLink | None = None  # a kept pool's (--keep): its keeper, told of every change
        self.ready: set[int] = set()
        self.started = False
        self.old_group: tuple | None = None  # once its group was made anew: what the ranks had bound to the old one
        self.on_loss = self.mend = None  # a pool's, from Pool.start: its --on-loss (options.OnLoss) and Mending.mend
        self.why: str | None = None  # how it ended, once closed ("stopped", "rank 1 exited: ...")
        self.cmd_fds: dict[int, int] = {}  # rank -> the kernel's end of its command pipe
        self._starter = None
        self.specs: dict = {}  # rank -> the RankSpec it was forked with
        self.started_at = time.time()
        self.local = None
        self._job_for = None  # a rank's job, given its command pipes (a replacement's too)
        # what each fork is given besides (its store pipes: the kernel's store, and the thread serving them)
        self._prepare = None

    # who its ranks are, where, in which generation of their process group: its Membership's (the one authority)
    plan = property(lambda self: self.members.plan)
    world_size = property(lambda self: self.members.world_size)
    generation = property(lambda self: self.members.generation)

    def next_generation(self) -> int:
        """A fresh process group (``Regroup``), its generation: ``Membership.next_generation`` (a keeper told)."""
        generation = self.members.next_generation()
        keeping.hold(self)
        return generation

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
        self.cmd_fds = {r: w for r, (_, w) in pipes.items()}
        self._starter = starters.starter_for(self.plan)(self.run_dir)
        self.started = True
        prepare = None
        if self.piped:  # the process group meets on the kernel's store, over pipes
            self.local = groupstore.LocalStores(groupstore.Store())
            prepare = starters.store_pipes(self.local)
        self._job_for, self._prepare = job_for, prepare
        try:
            self.keeper = keeping.start(self)  # a kept pool's (--keep), first: its ranks are tied to its life
            self._starter.ready(self.config)
            self.specs = {spec.rank: keeping.tied(spec, self.keeper)
                          for spec in starters.rank_specs(self.config, self.plan, self.run_dir)}
            starters.fork_specs(self.sup, self._starter, job_for(pipes), list(self.specs.values()), deadline,
                                keeping.kept_out(self.keeper, prepare))
        finally:
            for read, _ in pipes.values():
                os.close(read)
            if self.local is not None:
                self.local.start()
        keeping.hold(self)

    def replace(self, rank: int) -> None:
        """A new rank ``rank`` in place of the one that ended: forked as it was (same device, environment and
        start method, from the kernel as it is now), its own command pipe, joining the process group's
        generation now (``next_generation`` first: the survivors make it with ``Regroup``)."""
        self.forget_ended([rank])
        old = self.cmd_fds.pop(rank, None)
        if old is not None:
            os.close(old)
        try:
            self._fork_one(starters.again(self.specs[rank], self.generation))
        except Exception as e:  # (out of memory, no process left to fork: no child was made, unless it is listed)
            started = any(p.rank == rank and p.exit is None for p in self.sup.procs)
            raise ReplaceFailed(f"{type(e).__name__}: {e}", started=started) from e

    def forget_ended(self, ranks) -> None:
        """The ranks of ``ranks`` that ended (their descriptors closed as they were reaped) are no longer the
        loop's, nor ready: their replacements are awaited."""
        self.members.forget(ranks)
        self.ready.difference_update(ranks)

    def room(self, n: int) -> tuple:  # devices for n more ranks (%ddp resize): Membership.room
        return self.members.room(n)

    def grow(self, world_size: int, device_ids: tuple) -> None:
        """Ranks ``self.world_size .. world_size - 1`` added on ``device_ids`` (``room``'s, one each), joining a
        fresh group at ``world_size`` (``Membership.grow``; the ranks there make it with ``Regroup``, at the new
        size)."""
        for rank in self.members.grow(device_ids[:world_size - self.world_size]):
            self._fork_one(starters.again(self.specs[rank], self.generation))

    def _fork_one(self, spec) -> None:
        """One rank forked from ``spec`` into the running gang, with its own command pipe."""
        spec = keeping.tied(spec, self.keeper)  # (a kept pool's: tied to its keeper, this kernel's sockets let go)
        self.ready.discard(spec.rank)
        self._starter.ready(self.config)  # (the kernel's OpenMP threads released again: it ran ops since)
        read, write = os.pipe()
        others = list(self.cmd_fds.values())  # no other rank's command pipe in the new one

        def prepare(spec):
            spec, not_inherited, forked = keeping.kept_out(self.keeper, self._prepare)(spec)
            # nor the kernel's shared-memory arenas made since the start: a rank maps what it is sent by
            # /proc, and an inherited descriptor would keep memory the kernel lets go for the rank's life
            return spec, [*not_inherited, *others, *driverwatch.device_fds(("/memfd:",))], forked

        try:
            with contextlib.ExitStack() as failed:  # whatever stopped the fork, an interrupt too: its end closed
                failed.callback(os.close, write)
                starters.fork_specs(self.sup, self._starter, self._job_for({spec.rank: (read, write)}), [spec], None,
                                    prepare)
                failed.pop_all()  # forked: the end is the rank's command pipe
        finally:
            os.close(read)
        self.cmd_fds[spec.rank] = write
        proc = self.sup.procs[-1]
        self.sup.bus.publish(Started(proc.rank, proc.pid))  # the pool's view watches it
        keeping.hold(self)

    def retire(self, ranks: list[int], *, kill: bool = False) -> None:
        """``ranks`` leave: told to stop, given STOP_S to exit, then killed (``kill``: at once); reaped, forgotten."""
        procs = [p for p in self.sup.live() if p.rank in ranks]
        for p in procs:
            p.stop_sent = True  # (nbddp ends them: not a loss)
        if not kill:
            self.command(messages.Stop(), ranks=ranks)
            end = time.monotonic() + timeline.STOP_S
            self.sup.wait(None, until=lambda: all(p.exit is not None for p in procs) or time.monotonic() >= end,
                          wake_at=end)
        for p in procs:
            if p.exit is None:
                p.stop_sent = True
                p.signal(signal.SIGKILL)
        self.sup.wait(None, until=lambda: all(p.exit is not None for p in procs))

    def renumber(self, moves: dict) -> None:
        """The pool shrunk to the ranks of ``moves`` (old -> new) in a fresh group: ``Membership.renumber``'s Moved."""
        self.members.renumber(moves)

    def on_Moved(self, event) -> None:
        """Ranks moved (``Membership``): their command pipes, readiness, specs (a new rank's made from rank 0's, on
        its device) and their names in the debugger panel follow."""
        moves, first = event.moves, self.specs.get(0)
        rankdebug.renumbered({p.pid: p.rank for p in self.sup.procs})
        for rank in [r for r in self.cmd_fds if r not in moves]:
            os.close(self.cmd_fds.pop(rank))
        self.cmd_fds = {moves[r]: fd for r, fd in self.cmd_fds.items()}
        self.ready = {moves[r] for r in self.ready if r in moves}
        self.specs = {moves[r]: starters.moved(spec, moves[r], event.world_size) for r, spec in self.specs.items()
                      if r in moves}
        for rank in event.added:
            self.specs[rank] = dataclasses.replace(starters.moved(first, rank, event.world_size),
                                                   device_id=event.device_ids[rank])
        if not event.added:  # (ranks added are told once forked)
            keeping.hold(self)

    def here(self) -> list[int]:
        """The ranks forked on this machine (each has its command pipe here)."""
        return sorted(self.cmd_fds)

    def regroup_at(self, rank: int):
        """The command that moves ``rank`` (its number now) into the group's generation at the gang's size (a
        pool shrunk or resized: ``renumber`` or ``grow`` first)."""
        return messages.Regroup(self.generation, rank, self.world_size, self.place(rank))

    def place(self, rank: int) -> dict | None:
        """The environment that says ``rank``'s place where its number and the world size do not say it all
        (a cluster pool's: its place on its node); None on one machine."""
        return None

    def node_of(self, rank: int) -> str:
        """The node a rank runs on, as failures name it: none on one machine (a cluster pool's gang says)."""
        return ""

    def news_fds(self) -> list[int]:
        """Descriptors besides the ranks' pidfds that turn readable when a rank may have ended (a cluster
        pool's: its nodes' streams); between cells, the pool watches them all (losses.LossWatch)."""
        return []

    @property
    def alive(self) -> bool:
        return self.sup is not None and len(self.sup.live()) == self.world_size

    def command(self, cmd, ranks=None) -> None:
        """One framed command on every live rank's pipe (or those of ``ranks``)."""
        frame = framing.encode(cmd)
        for fd in (self.cmd_fds.values() if ranks is None else [self.cmd_fds[r] for r in ranks if r in self.cmd_fds]):
            try:
                framing.write_all(fd, frame)
            except BrokenPipeError:
                pass  # that rank is gone; the supervisor reports how

    def stop(self) -> None:
        """A pool's end: every rank leaves the group and exits; SIGTERM/SIGKILL whoever does not in STOP_S."""
        if self.sup is None:
            return
        end = time.monotonic() + timeline.STOP_S
        try:
            self.command(messages.Stop())
            self.sup.end_cell()
            self.sup.wait(None, until=lambda: time.monotonic() >= end, wake_at=end)
        finally:
            self.close("stopped")

    def close(self, why: str = "torn down", *, as_said: bool = False) -> None:
        """Stop whatever still runs, reap it, and release everything the gang holds (once). ``why``: how it
        ended, as the pool's view and its next cell say it (a rank's own death is named instead, unless
        ``as_said``: ``why`` names it already)."""
        if self.sup is None:
            return
        dead = [p.exit for p in self.sup.procs if p.exit is not None and not p.exit.stopped]
        cause = failure.root_cause(dead) or (dead[0] if dead else None)  # not a peer that died of its loss
        self.why = why if why == "stopped" or as_said or cause is None else \
            f"rank {cause.rank}{cause.where} exited ({cause.describe()})"
        if self.view is not None:
            self.view.finish(self.why if why == "stopped" else f"ended: {self.why}")
        sup, self.sup = self.sup, None
        keeping.end(self.keeper)  # (its keeper goes once its ranks have)
        sup.stop_all()
        sup.reap()
        sup.close()
        keeping.ended_with(self.keeper)
        for fd in self.cmd_fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.cmd_fds = {}
        if self.local is not None:
            self.local.close()  # (once: a cluster gang closes it too)
        self.logs.close()
        self.run_dir.release_store()
        if self._starter is not None:
            self._starter.cleanup()


def adopted(taken, view_for=None, job_for=None) -> Gang:
    """The gang of a kept pool this kernel took (keeping.take's ``(link, Taken, KeptState, ranks)``): its ranks
    as they are (not this kernel's children: their ends seen on their pidfds), their pipes, a store of this
    kernel's for the groups they make from now on (what they wrote while no kernel held them: taking.LeftRunning)."""
    link, _, state, ranks = taken
    gang = Gang(state.config, state.plan, persistent=True, view_for=view_for, run_dir=state.run_dir,
               generation=state.generation)
    gang.keeper, gang.specs, gang.started, gang.started_at = link, dict(state.specs), True, state.started_at
    gang._starter = starters.starter_for(gang.plan)(gang.run_dir)
    gang.local = groupstore.LocalStores(groupstore.Store())
    gang._job_for, gang._prepare = job_for, starters.store_pipes(gang.local)
    for kept, fds in sorted(ranks, key=lambda r: r[0].rank):
        fd = dict(zip(kept.fds, fds))
        proc = RankProc(kept.rank, kept.pid, fd["pidfd"],
                        {fd["stdout"]: "stdout", fd["stderr"]: "stderr", fd["channel"]: "channel"},
                        published={"stdout": None, "stderr": None}, reap=_not_a_child)
        if "store_request" in fd:
            proc.store_fds = (fd["store_request"], fd["store_reply"])
            gang.local.add(*proc.store_fds)
        gang.cmd_fds[kept.rank] = fd["command"]
        gang.sup.add(proc)
        gang.ready.add(kept.rank)
    gang.local.start()
    keeping.ends_at_exit(gang)  # (--keep auto: a deliberate end of this kernel ends it)
    return gang


def _not_a_child():
    """A rank of a kept pool this kernel took: not its child, so no wait status (its own last words say how it
    ended: supervisor._exit_code)."""
    return None, 0


def let_go(gang: Gang) -> None:
    """A taken pool handed back to its keeper as it is (a take that did not finish): every descriptor of this
    kernel's closed, no rank signalled; the keeper, seeing its end close, keeps the pool again (a gang closed
    meanwhile: nothing to hand back)."""
    if gang.sup is None:
        return
    sup, gang.sup = gang.sup, None
    sup.close()
    for fd in gang.cmd_fds.values():
        os.close(fd)
    gang.cmd_fds = {}
    gang.local.close()
    gang.logs.close()
    gang.keeper.close()
