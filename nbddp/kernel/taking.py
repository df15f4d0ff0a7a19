"""A kept pool taken by this kernel (``%ddp attach``, "Run All"'s ``%ddp start``): its gang made again on the
keeper's descriptors, and the cell the last kernel left running in its ranks seen to its end.

- ``taken``: the pool, this kernel's from now on (``keeping.take``, ``gang.adopted``, ``Pool.begin``), and what
  the last kernel left running in its ranks (``LeftRunning``), if anything.
- ``LeftRunning``: what the ranks wrote while no kernel held them, fed to this kernel's supervisor once (its logs
  skip it: the keeper wrote them), then this kernel's first call, whose answer comes once that cell is over. A
  cell the notebook was running (interrupted by the keeper as its kernel died) is waited for at once
  (``settle``); a ``--bg`` training goes on as a background cell of this kernel (``work``, a ``background.Job``'s):
  its output shown where it runs, from what it printed while no kernel held the pool on.
"""
from __future__ import annotations

import contextlib
import sys
import time

from .. import timeline, units
from ..errors import RankFailure
from ..rank.jobs import CallJob
from ..rank.server import INTERRUPT
from ..views.display import line_for_pool_cell, view_for_pool
from ..wire import messages, values
from . import metrics
from .cells import engine
from .pool import Pool
from .ranks import keeping
from .ranks.gang import adopted, let_go


def taken(namespace: dict | None, pool_id: str) -> tuple[Pool, "LeftRunning"]:
    """The kept pool ``pool_id``, this kernel's from now on: its ranks hold what they held, the notebook's names
    reach them as a spawned pool's do (they are no forks of this kernel); and what its ranks still have to say
    (``LeftRunning``: ``settle()`` it, or run its ``work`` as a background cell, before any other cell). Whatever
    stops the take, the pool goes back to its keeper, kept as it was."""
    got = keeping.take(pool_id)
    pool = Pool(namespace)
    pool.config = got[2].config
    with contextlib.ExitStack() as failed:
        failed.callback(keeping.give_back, got)
        gang = pool.gang = adopted(got, view_for=view_for_pool, job_for=pool.job_for)
        failed.pop_all()
        failed.callback(let_go, gang)
        pool.view = gang.view
        pool.view.started = gang.started_at  # (up since the last kernel started it)
        pool.begin(gang.plan, inherited=False)
        failed.pop_all()
    told = got[1]
    about = told.about  # what the ranks hold, as the last kernel said, and the cell it left running
    pool.bound_by.update(dict.fromkeys(about.names, "a cell of the kernel before"))
    gang.keeper.said = (tuple(about.names), about.running, about.background, about.cell, tuple(about.brings))
    for rank, streams in sorted(told.dropped.items()):
        for stream, n in streams.items():
            if n:
                print(f"nbddp: rank {rank} wrote more to {stream} while no kernel held the pool than the keeper keeps "
                      f"for the cell: {units.size(n)} of it is in its log only ({gang.run_dir.log(rank)})",
                      file=sys.stderr)
    return pool, LeftRunning(pool, told)


class LeftRunning:
    """What a taken pool's ranks still have to say to this kernel: what they wrote while no kernel held them, and
    the answer of the cell the last kernel left running in them (``label``: its first line; ``background``: a
    ``--bg`` one, which goes on). Seen to its end once, before any other cell (``settle`` or ``work``); then the
    pool's watch for lost ranks is armed and its keeper told that nothing runs."""

    def __init__(self, pool: Pool, told):
        self.pool, self.told = pool, told
        self.label, self.background = told.about.running, told.about.background
        self.cell = told.about.cell or f"{self.label or 'a cell'} (the kernel before)"  # (its rows go on under it)
        self.brings = tuple(told.about.brings)  # (its --out/--gather names: a --bg one's come to this kernel)
        self.recorder: metrics.Recorder | None = None  # (``_history``)

    def _history(self) -> None:
        """The pool's curves go on: what its ranks logged under the last kernel (the run's metrics.csv, as it wrote
        it), then what they log from now on (what the keeper kept first), filed by ``recorder``. Only for a pool
        taken for cells: ``%ddp stop ID`` files nothing in this kernel's ``nbddp.metrics()``."""
        metrics.LOGBOOK.load_csv(str(self.pool.gang.run_dir.path))
        self.recorder = metrics.Recorder(self.cell, self.pool.gang.run_dir.path)

    def settle(self) -> None:
        """Here, at once: an interrupt (Jupyter's) interrupts that cell in the ranks; a second one stops waiting (the
        pool goes back to its keeper). With no cell left running, ranks silent past ``timeline.TAKE_S`` end the
        pool (``_answered``)."""
        self._history()
        with contextlib.ExitStack() as failed:
            failed.callback(let_go, self.pool.gang)
            self._answered([], on_start=None, give_up=True, within=None if self.label else timeline.TAKE_S)
            failed.pop_all()
        self.over()

    def work(self, on_start) -> list:
        """A background cell's work (``background.Job``): the ranks' text shown in its output, replayed first; each
        ``%ddp interrupt`` interrupts the cell in the ranks. Raises as the cell ended, if not well."""
        pool = self.pool
        gang = pool.gang
        self._history()
        relay = engine.new_relay(pool.config, f"{gang.run_dir.run_id}-taken", range(gang.world_size))
        line = line_for_pool_cell()  # its line, and the chart of what it logged from its first step on
        for rank, rec in metrics.LOGBOOK.cell_records(str(gang.run_dir.path), self.cell):
            line.chart.add(rank, rec)
        line.begin(gang.plan, gang.run_dir)
        pool.view.cell_began(f"{self.label} (the kernel before)")  # (the pool's view: busy with it)
        with _Ended(self, relay, line):
            with pool.one_cell(), keeping.cell_told(gang, pool.bound_by, self.label, self.cell, self.brings):
                first = self._answered([relay, engine.RelayClock(relay, gang.sup), line], on_start, give_up=False)
                per_rank = _outcome(first, self.label, str(gang.run_dir.path))
                pool.answered(per_rank, self.cell)  # (before the keeper is told the names they hold: cell_told's end)
            return per_rank

    def _answered(self, listeners: list, on_start, give_up: bool, within: float | None = None) -> dict:
        """Until every rank answered this kernel's first call: each rank's first answer before it (the cell's).
        ``within``: idle ranks answer within it, or the pool is ended (ranks that hang the take are not kept)."""
        gang = self.pool.gang
        sup, token = gang.sup, f"nbddp-taken-{time.time_ns()}"
        answered, first = set(), {}

        class Answers:
            def on_Message(self, event) -> None:
                rec = event.record
                if isinstance(rec, messages.Result) and rec.value is not None and rec.value.blob is not None \
                        and values.loads(rec.value.blob) == token:
                    answered.add(event.rank)
                elif isinstance(rec, (messages.Result, messages.Error, messages.Exit)):
                    first.setdefault(event.rank, rec)

        sup.begin_cell([Answers(), self.recorder, *listeners],
                       tick=getattr(gang.view, "interval", None))  # (the pool's view redrawn while it waits)
        try:
            with gang.logs.kept_already():  # (the keeper wrote it into their logs)
                _replay(sup, self.told)
            gang.command(messages.Call(values.to_ranks(CallJob(str, (token,), 1 << 16))))
            if on_start is not None:
                on_start(gang)
            end = time.monotonic() + within if within is not None else None
            self._wait(sup, lambda: answered >= {p.rank for p in sup.live()} or end and time.monotonic() >= end,
                       give_up, end)
        finally:
            sup.end_cell()
            self.recorder.finish()
        silent = sorted({p.rank for p in sup.live()} - answered)
        if silent:
            why = (f"rank(s) {', '.join(map(str, silent))} did not answer this kernel's first call within {within:g} s "
                   "while no cell ran in them")
            gang.close(why, as_said=True)
            raise RankFailure(f"the kept pool could not be taken: {why}, so its ranks cannot be vouched for; it has "
                              f"ended. Their logs: {gang.run_dir.path}\n%ddp start begins a new pool.", rank=silent[0],
                              cause="take")
        if len(answered) < gang.world_size:
            raise RankFailure("the kept pool's ranks ended while it was being taken; see its logs: "
                              f"{gang.run_dir.path}", rank=None, cause="take")
        return first

    def _wait(self, sup, until, give_up: bool, end: float | None = None) -> None:
        interrupted = False
        while True:
            try:
                sup.wait(None, until=until, wake_at=end)
                return
            except KeyboardInterrupt:
                if interrupted and give_up:
                    print("nbddp: the pool was not taken; it stays kept (%ddp attach again)", file=sys.stderr)
                    raise
                interrupted = True
                if give_up:
                    print(f"nbddp: interrupting {'the cell the last kernel left running in ' if self.label else ''}"
                          "the ranks (interrupt again to stop waiting)", file=sys.stderr)
                for p in sup.live():
                    p.signal(INTERRUPT, group=False)

    def over(self) -> None:
        """Seen to its end: the keeper told nothing runs, the pool's watch for lost ranks armed."""
        keeping.tell(self.pool.gang, self.pool.bound_by, "")
        self.pool.mending.watch.arm()


def _replay(sup, told) -> None:
    """What the ranks wrote while no kernel held them, fed to ``sup`` as they wrote it: their text and records in
    the order the keeper read them (``Taken.order``: across ranks, not rank by rank; a record's marks place it
    among its rank's text). Their pipes, which hold what came after, are not read meanwhile."""
    procs = {p.rank: p for p in sup.procs}
    fed: dict = {}
    for proc in procs.values():
        proc.replaying = True
    try:
        for rank, stream, n in told.order:
            if rank in procs:
                at = fed.get((rank, stream), 0)
                sup.feed(procs[rank], stream, told.buffered[rank][stream][at:at + n])
                fed[rank, stream] = at + n
        for rank, proc in procs.items():
            for stream in ("stdout", "stderr", "channel"):
                rest = told.buffered.get(rank, {}).get(stream, b"")[fed.get((rank, stream), 0):]
                if rest:
                    sup.feed(proc, stream, rest)
    finally:
        for proc in procs.values():
            proc.replaying = False


class _Ended:
    """However ``LeftRunning.work`` ends: the pool's watch armed and keeper told, the relay's last lines out, the
    cell's line and the pool's view told how."""

    def __init__(self, left: LeftRunning, relay, line):
        self.left, self.relay, self.line = left, relay, line

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, _tb) -> None:
        self.left.over()
        self.relay.close_all()
        self.line.finish(error)
        ended = "ok" if kind is None else "interrupted" if issubclass(kind, KeyboardInterrupt) else "failed"
        self.left.pool.view.cell_ended(ended)


def _outcome(first: dict, label: str, log_dir: str) -> list:
    """The --bg cell the last kernel left running, as it ended on each rank: its Results; an interrupt as one; a
    failure named with its rank (its traceback is in the cell's output above, and in the rank's log)."""
    errors = {r: rec for r, rec in sorted(first.items()) if isinstance(rec, messages.Error)}
    if any(rec.type == "KeyboardInterrupt" for rec in errors.values()):
        raise KeyboardInterrupt(f"{label}: interrupted in its ranks")
    if errors:
        rank, err = next(iter(errors.items()))
        raise RankFailure(f"rank {rank} failed the cell the last kernel left running ({label}): {err.type}: "
                          f"{err.message}\nIts traceback is in the rank's log: {log_dir}", rank=rank, cause="cell")
    return [rec if isinstance(rec, messages.Result) else messages.Result() for _, rec in sorted(first.items())]
