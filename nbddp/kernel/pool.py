"""A pool: ranks forked from the kernel once, living across cells (``%ddp start``, ``nbddp.Pool``).

The ranks share the notebook's data as it was at the start, copy-on-write, and join the process group
once; each ``%%ddp`` cell is then a command on every rank's command pipe, run by the one cell engine
(engine.py, which also holds the failure rules). A notebook name a cell reads that was created or
rebound since the start is sent once: the pool's ``sending.RankNames`` keeps what the ranks hold of the
notebook's names.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time

from ..errors import RankFailure, UsageError
from ..rank.jobs import CallJob
from ..rank.server import Server
from ..views import output
from ..views.display import view_for_pool
from ..wire import messages, values
from . import checks, metrics, options
from .cells import engine
from .healing.losses import Losses
from .healing.mending import Mending
from .names.sending import RankNames
from .ranks import failure, keeping, starters
from .ranks.gang import Gang, let_go

START_S = 600.0  # the ranks of a new pool must all be in the process group by then
NO_POOL = "no pool is running (%ddp start [options] starts one)"
_make_cluster_gang = None  # what makes a --cluster pool's gang (register_cluster_gang)


def register_cluster_gang(make) -> None:
    """``make(config, plan, view_for=...)`` makes a ``--cluster`` pool's gang (cluster/'s
    ``ClusterGang``). cluster/ sits above the kernel, so the package that hands out the pool registers it
    (nbddp's ``__init__``, for ``nbddp.Pool`` and ``%load_ext``): the pool names no cluster module, and the
    cluster's modules and Ray are imported only when such a pool starts."""
    global _make_cluster_gang
    _make_cluster_gang = make


class Pool:
    """``with nbddp.Pool(devices=2) as pool: pool.run(fn, *args)`` — or ``%ddp start`` in a notebook.

    Options are ``%%ddp``'s, by keyword: those fixed when ranks start hold for the pool's life, the
    per-cell ones (``timeout``, ``ranks_output``, ...) become the defaults of its cells."""

    def __init__(self, namespace: dict | None = None, **opts):
        self.config = options.config(opts)
        self.namespace = namespace
        self.gang: Gang | None = None
        self.view = None  # its dashboard (poolview.PoolView), from start() on
        self.last_failed: int | None = None  # the rank whose failure ended the last failed cell (%ddp debug)
        self.started_at: float | None = None  # time.time() once its ranks are up
        self.held = RankNames(namespace)  # what the ranks hold of the notebook's names (made anew at start())
        self._turn = threading.Lock()  # one cell in the ranks at a time (a background cell's thread, the notebook's)
        self.losses = Losses()  # its ranks lost (made anew at start())
        self.bound_by: dict[str, str] = {}  # a name its cells bound -> the cell that bound it last
        self.mending = Mending(self)  # what it does when it loses a rank (--on-loss), %ddp resize
        self.starter = None  # what its start method means (starters.Starter), from start() on

    # -- life --------------------------------------------------------------------------------------
    def check(self) -> None:
        """What refuses this pool whatever the devices' state (its options, a spawned pool), with nothing
        changed: ``%ddp restart`` asks before it stops the running pool."""
        checks.refusals(self.config, pool=True)

    def start(self) -> "Pool":
        plan = checks.preflight(self.config, pool=True)
        with checks.one_at_a_time():
            if self.config.cluster:  # ranks on several nodes (imports Ray only then)
                if _make_cluster_gang is None:
                    raise UsageError("--cluster: nbddp's cluster pools are handed out by `import nbddp` (nbddp.Pool, "
                                     "or %load_ext nbddp); this pool was made from nbddp.kernel.pool directly.")
                gang = self.gang = _make_cluster_gang(self.config, plan, view_for=view_for_pool)
            else:
                gang = self.gang = Gang(self.config, plan, persistent=True, view_for=view_for_pool)
            self.view = gang.view
            done = False
            try:
                gang.start(self.job_for)
                self.begin(plan, inherited=starters.starter_for(plan).inherits_notebook)
                end = time.monotonic() + START_S
                gang.sup.wait(None, until=lambda: len(gang.ready) == gang.world_size or time.monotonic() >= end,
                              wake_at=end)
                done = True
            finally:
                if not done:  # whatever stopped it, an interrupt too: nothing may be left running
                    gang.close()
        if len(gang.ready) < gang.world_size:
            exits = [p.exit for p in gang.sup.procs if p.exit is not None]
            gang.close()
            raise failure.rank_failed(exits, {}, str(gang.run_dir.path)) if failure.root_cause(exits) else \
                RankFailure(f"the pool's ranks did not come up within {START_S:g} s; nothing is left running.",
                            rank=None, cause="start")
        self.mending.watch.arm()
        return self

    def job_for(self, pipes) -> Server:
        """Its ranks' job, given their command pipes (a replacement's too)."""
        return Server(cmd_pipes=pipes, namespace=self.namespace)

    def begin(self, plan, inherited: bool) -> None:
        """Its ranks are there (forked, or taken from a keeper): what the pool keeps of them, and its rules."""
        gang = self.gang
        self.started_at = gang.started_at
        self.starter = starters.starter_for(plan)
        self.held = RankNames(self.namespace, across_nodes=bool(self.config.cluster), inherited=inherited,
                              gpu_ipc=self.starter.gpu_ipc(plan))
        gang.sup.announce()
        self.losses = Losses(self.view)
        gang.sup.listen(self.losses)
        # its --on-loss (options.OnLoss), asked by its cells' rules and its supervisor (a lost rank's peers
        # kept up to be mended: heal, shrink; or stopped: end), and what acts on it
        gang.on_loss = gang.sup.on_loss = self.config.loss_policy
        gang.mend = self.mending.mend

    @property
    def plan(self):
        return self.gang.plan

    @property
    def run_dir(self):
        return self.gang.run_dir

    def show(self) -> None:
        """Display the pool's dashboard here (``%ddp start`` and ``%ddp status`` do): one live output."""
        self.view.show()

    @property
    def alive(self) -> bool:
        """Its ranks are all up, or it lost some and will mend itself before its next cell."""
        return self.gang is not None and (self.gang.alive or self.mending.waiting)

    @property
    def ended(self) -> str | None:
        """How the pool ended other than by stop(): None while it runs (or once stopped)."""
        if self.gang is None or self.alive or self.gang.why == "stopped":
            return None
        return self.gang.why or "its ranks are gone"

    def lost(self) -> str:
        """What a cell sent to a pool that ended says, with what to do."""
        return (f"the pool has ended: {self.ended}; nothing ran, and its ranks' state is gone.\n"
                "%ddp restart starts a new pool with the same options; %ddp stop goes back to one-shot cells.")

    def stop(self) -> None:
        """Ask every rank to leave the group and exit; SIGTERM/SIGKILL whoever does not within 5 s."""
        self.mending.watch.disarm()
        if self.gang is not None:
            self.gang.stop()

    def __enter__(self) -> "Pool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- cells ---------------------------------------------------------------------------------------
    def run(self, fn, *args) -> list:
        """``fn(*args)`` on every rank, in the pool; each rank's return value, in rank order (a value that
        cannot come back raises ResultError naming the rank, as ``nbddp.launch`` does)."""
        return self.run_job(CallJob(fn, args, options.max_value_bytes(self.config)), getattr(fn, "__name__", "call"))

    def run_job(self, job, label: str) -> list:
        """``job(ctx)`` on every rank (a job that needs the rank's context, such as its namespace: %ddp who);
        each rank's value, as ``run``."""
        with self.one_cell():
            self.mending.before_cell()
            outcome = self._engine(self.config, label).run(command=messages.Call(values.to_ranks(job)))
        return engine.returned(outcome.results())

    def cell(self, source: str, filename: str, **kw) -> list:
        """A %%ddp cell in the pool, once no other cell is in its ranks; each rank's Result (``_cell``)."""
        with self.one_cell(), keeping.cell_told(self.gang, self.bound_by, source, metrics.cell_name(),
                                                (*kw.get("outs", ()), *kw.get("gathers", ()))):
            return self._cell(source, filename, **kw)

    def _cell(self, source: str, filename: str, *, outs=(), gathers=(), code=None, relabel=None,
              observer=None, ranks=None, post_mortem=False, on_start=None, debug=None, **per_cell) -> list:
        """A %%ddp cell in the pool; each rank's Result (of ``ranks`` only, if given). ``code``: the names
        the cell reads. ``post_mortem``: IPython's %pdb. ``on_start``: engine.CellRun's. ``per_cell``: the
        cell's own options (checked by the caller), over the pool's."""
        config = options.config(per_cell, base=self.config)
        self.mending.before_cell()
        world = self.gang.world_size if self.gang else 0
        if ranks and max(ranks) >= world:
            raise UsageError(f"--ranks {','.join(map(str, ranks))}: the pool has rank(s) 0-{world - 1}; nothing ran.")
        # the other nodes lack what the notebook had at the start (RankNames pickles for other machines)
        sync = self.held.before_cell(code or set(), nodes_running=bool(self.config.cluster) and self.alive)
        if sync.for_other_nodes:
            self.gang.owe(sync.for_other_nodes)  # with the next command to each other node's rank
        notes, updates = sync.notes, sync.updates
        label = (relabel or {}).get(filename) or (source.strip().splitlines() or [""])[0]
        run = self._engine(config, label, relabel, observer, ranks, on_start)  # (an ended pool refuses the cell)
        self.held.sent(sync)
        place = output.current()  # this cell, or a background cell's own output
        for line in notes:
            place.write("stderr", f"nbddp: {line}\n")
        if notes:
            place.flush("stderr")  # before the ranks' output, where it belongs
        if ranks and (updates or sync.dropped) and self.alive:  # the ranks left out get the notebook's latest too
            self.gang.command(messages.Update(updates, sync.dropped), ranks=[r for r in range(world) if r not in ranks])
        cmd = messages.RunCell(source, filename, tuple(outs), tuple(gathers), options.max_value_bytes(config),
                               updates, post_mortem=post_mortem, lead=ranks[0] if ranks else 0, dropped=sync.dropped,
                               debug=debug)
        try:
            outcome = run.run(command=cmd)
        except RankFailure as e:
            self.last_failed = e.rank  # %ddp debug's default rank
            raise
        for note in outcome.notes:
            place.write("stderr", f"nbddp: {note}\n")
        per_rank = outcome.results()
        self.answered(per_rank, label)
        return per_rank

    def answered(self, per_rank, label: str) -> None:
        """A cell's Results: the names each rank bound are the ranks' own (``label``: the cell that bound them)."""
        self.held.answered(per_rank)
        self.bound_by.update({name: label for res in per_rank for name in res.assigned})

    def notebook_bound(self, names) -> None:
        """A notebook cell bound ``names``: the notebook's latest word, sent to the ranks at the next cell
        that reads them, even if equal to an older value."""
        self.held.notebook_bound(names)

    def debug(self, rank: int | None = None) -> None:
        """pdb in the traceback of ``rank``'s last failed cell (default: the rank that failed last), in the
        notebook; the other ranks wait. ``%ddp debug [RANK]``."""
        rank = self.last_failed if rank is None else rank
        if rank is None:
            raise UsageError("%ddp debug: no cell of this pool has failed on a rank; give the rank (%ddp debug 1).")
        if not 0 <= rank < self.gang.world_size:
            raise UsageError(f"%ddp debug {rank}: the pool has rank(s) 0-{self.gang.world_size - 1}.")
        with self.one_cell():
            self.mending.before_cell()
            self._engine(self.config, f"debug rank {rank}", ranks=[rank]).run(command=messages.PostMortem())

    @property
    def busy(self) -> bool:
        """A cell (or a mending) holds the ranks now."""
        return self._turn.locked()

    @contextlib.contextmanager
    def turn_if_free(self):
        """The ranks' turn if no cell holds them now (yields True; released after), else yields False at once."""
        got = self._turn.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._turn.release()

    @contextlib.contextmanager
    def one_cell(self):
        """The ranks for one cell: another thread's cell (a background one) ends first, said once. The watch
        for lost ranks stands aside meanwhile (the cell's own loop sees them: ``LossWatch.aside``)."""
        if not self._turn.acquire(blocking=False):
            print("nbddp: waiting for the pool's cell running in the background to end", file=sys.stderr, flush=True)
            self._turn.acquire()
        self.mending.watch.aside()
        try:
            yield
        finally:
            self._turn.release()
            self.mending.watch.arm()

    def _engine(self, config, label, relabel=None, observer=None, ranks=None, on_start=None) -> engine.CellRun:
        self.mending.refuse_while_waiting()
        if self.ended:
            raise UsageError(self.lost().replace("%ddp restart", "Pool.start()").replace(
                "; %ddp stop goes back to one-shot cells", ""))
        if not self.alive:
            raise UsageError("the pool is not running: %ddp start (or Pool.start()) first.")
        return engine.CellRun(self.gang, config, label=label, relabel=relabel, observer=observer, ranks=ranks,
                              on_start=on_start)

    # -- what %ddp status shows ------------------------------------------------------------------------
    def status(self) -> str:
        if self.ended:
            return f"nbddp pool · ended: {self.ended} (%ddp restart starts a new one, %ddp stop forgets it)"
        if not self.alive:
            return NO_POOL
        self.view.sample(uss=True)
        return self.view.render_text()

    def conflicts(self, explicit: dict) -> list[str]:
        """Options a %%ddp cell gave that the running pool cannot honour."""
        return [f"--{k.replace('_', '-')} {v} (the pool has {getattr(self.config, k)})"
                for k, v in explicit.items() if k in options.POOL_FIXED and str(v) != str(getattr(self.config, k))]


def detach(pool: Pool) -> str:
    """``%ddp detach``: the pool handed to its keeper as it is, its ranks and their state
    kept, this kernel no longer holding it; it waits as its ``--keep`` says (auto: ``options.KEEP_AUTO_S``) for a
    kernel of this user to take it (``%ddp attach ID``, this one too). Its id. Refused, nothing changed, for a pool
    that has no keeper, lost ranks not yet mended, or a cell running in its ranks."""
    gang = pool.gang
    if not pool.alive:
        raise UsageError(f"%ddp detach: {NO_POOL}. Nothing changed.")
    if gang.keeper is None:
        raise UsageError("%ddp detach: this pool has no keeper to hand it to (started with --keep off, or one that "
                         "cannot be kept: from the forkserver, across Ray nodes, or without pidfds); nothing changed. "
                         "%ddp restart --keep 1h starts a pool that can be.")
    if pool.mending.waiting:
        raise UsageError("%ddp detach: the pool lost rank(s) and mends them before its next cell; a keeper keeps "
                         "no pool that lacks ranks. Run a cell first (it mends the pool). Nothing changed.")
    with pool.turn_if_free() as free:
        if not free:
            raise UsageError("%ddp detach: a cell is running in the pool's ranks (a background one); %ddp wait for "
                             "it or %ddp interrupt it, then detach. Nothing changed.")
        pool.mending.watch.disarm()
        pool_id = keeping.pool_id(gang.run_dir)
        pool.view.finish(f"detached: kept pool {pool_id}, waiting for a kernel (%ddp attach {pool_id})", "kept")
        keeping.reap_when_gone([p.pid for p in gang.sup.procs if p.reap is None])  # (this kernel's children)
        let_go(gang)
        gang.why = f"detached (kept pool {pool_id})"
    return pool_id
