"""A pool that survives a lost rank (``%ddp start --on-loss heal|shrink|end``): the loss known at once, said,
and the pool mended without the user doing anything.

- ``Losses`` (a lifelong listener of the pool's supervisor) records each rank that died: its number, the
  cause in words, the cell it was running, when. Between cells, ``LossWatch`` puts the ranks' pidfds on the
  kernel's event loop (the main thread, between cells, as the pool's view redraws), so a rank killed while
  the pool is idle is known within milliseconds, said in the pool's view and ``%ddp status``, and mended
  there and then; where no event loop runs (a script's ``nbddp.Pool``) the next cell finds it first.
- ``mend`` heals (a replacement with the lost rank's number and device, forked as the rank was, joins the
  survivors in a new process group at the same world size, and takes the pool's state from a survivor:
  rank/heal.py) or shrinks (the survivors renumbered in order, a new group at N-1); either way every
  DistributedDataParallel in a rank's namespace is made anew on the new group. A replacement that cannot
  start, none having started (no memory, no node with the room), shrinks the pool instead, saying why.
  Whatever else fails while mending (a second rank lost, a step that does not answer within its time, an
  interrupt) ends the pool with that reason: nothing hangs, nothing is left running.

Each step is a ``Call`` of one of rank/heal.py's functions on some ranks, its answers awaited on the
supervisor's loop with a deadline (``ask``), as a cell's are.
"""
from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time

from .. import timeline, units
from ..errors import RankFailure, UsageError
from ..rank import heal
from ..views import output
from ..wire import messages, values
from .ranks import starters
from .ranks.gang import ReplaceFailed

POLICIES = ("heal", "shrink", "end")
UNLIMITED = 1 << 62  # an export's pickle may be as big as it is: it goes once, from one peer


class HealFailed(RuntimeError):
    """Mending the pool failed; the message says what happened, on which rank."""


@dataclasses.dataclass
class Loss:
    rank: int
    cause: str  # in words, as a failed cell says it ("killed by SIGKILL: ...")
    cell: str | None  # the cell it was running, if any
    at: float  # time.time() the kernel saw it

    def line(self) -> str:
        during = f" while running {self.cell}" if self.cell else " while idle"
        return f"rank {self.rank} lost{during}: {self.cause}"


class Losses:
    """The pool's supervisor's lifelong listener: each rank that ended without being asked to."""

    def __init__(self, view=None):
        self.view = view
        self.pending: list[Loss] = []  # not mended yet
        self.history: list[Loss] = []

    def on_Exited(self, event) -> None:
        exit = event.exit
        if exit.stopped or exit.only_leaving or exit.ok:
            return  # nbddp ended it (a stop, a teardown, a pool resized), or it left after its work
        running = getattr(self.view, "running", None) if self.view is not None else None
        loss = Loss(event.rank, exit.describe(), running, exit.seen if math.isfinite(exit.seen) else time.time())
        self.pending.append(loss)
        self.history.append(loss)
        if self.view is not None:
            self.view.said(loss.line(), at=loss.at)


class LossWatch:
    """Between cells, the pool's live ranks' pidfds on the kernel's event loop (its main thread, between cells),
    and a cluster pool's nodes' streams (``Gang.news_fds``; a node silent for 5 s is lost): a rank that dies is
    reaped, said and mended at once (``Mending.between_cells``). A cell on the notebook's thread blocks that
    loop while it runs (its own loop sees its losses), so the watch stays set across it and is set anew only
    where its ranks changed (a pool cell pays no system call for it); a cell on another thread (a background
    one) takes it off first. Where no event loop runs (a script), nothing is set: the next cell finds the
    loss."""

    RETRY_S = 0.5  # a background cell holds the ranks: look again then (its own loop sees a loss meanwhile)

    def __init__(self, pool):
        self.pool = pool
        self.loop = None
        self.armed: set[tuple[int, int]] = set()  # (pidfd, pid) on the loop: a number reused by another rank differs

    def arm(self) -> None:
        """From any thread: the watch is set on the event loop's thread."""
        import asyncio

        if self.loop is None:
            try:
                self.loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no event loop here (a script): the next cell looks
        if threading.current_thread() is threading.main_thread():
            self._arm()
        else:
            self.loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        pool = self.pool
        if pool.gang is None or pool.gang.sup is None or self.loop.is_closed():
            self.disarm()
            return
        if pool.busy:  # a cell holds the ranks (a background one): it sees a loss itself
            self.disarm()
            self.loop.call_later(self.RETRY_S, self._arm)
            return
        wanted = {(p.exit_fd, p.pid) for p in pool.gang.sup.live() if p.here and p.exit_fd >= 0}
        wanted |= {(fd, 0) for fd in pool.gang.news_fds()}  # (another node's ranks: their agent's stream)
        if wanted != self.armed:
            self.disarm()
            for fd, _ in wanted:
                self.loop.add_reader(fd, self._fired)
            self.armed = wanted
        if pool.losses.pending:  # lost while a background cell held the ranks: mended now, between cells
            self.loop.call_soon(self._fired)

    def aside(self) -> None:
        """A cell begins: on another thread than the loop's, the watch is taken off (that thread's supervisor
        closes a dead rank's pidfd while the loop runs); on the loop's own thread the loop waits for the cell."""
        if threading.current_thread() is not threading.main_thread():
            self.disarm()

    def disarm(self) -> None:
        if self.loop is None:
            return
        if threading.current_thread() is not threading.main_thread():
            self.loop.call_soon_threadsafe(self.disarm)
            return
        for fd, _ in self.armed:
            self.loop.remove_reader(fd)  # (one closed since is forgotten all the same)
        self.armed = set()

    def _fired(self) -> None:
        self.disarm()
        pool = self.pool
        with pool.turn_if_free() as free:
            if not free:
                self.loop.call_later(self.RETRY_S, self._arm)
                return
            # the kernel ignores Jupyter's interrupt while idle; while it heals, the interrupt ends the healing
            previous = signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                pool.mending.between_cells()
            except KeyboardInterrupt:  # the pool has ended with the reason; the kernel's loop must go on
                pass
            finally:
                signal.signal(signal.SIGINT, previous)
        if pool.alive:
            self._arm()


class Mending:
    """A pool's side of it: what ``--on-loss`` does with the ranks it lost (``mend``: from a cell's end, the
    watch, or the next cell's start, ``before_cell``), ``%ddp resize``, and what is said of it, in the pool's
    view and in the next cell's output."""

    def __init__(self, pool):
        self.pool = pool
        self.watch = LossWatch(pool)
        self.unsaid: list[str] = []  # what mending said, not yet said in a cell's output

    @property
    def waiting(self) -> bool:
        """Ranks were lost and the pool will mend itself before its next cell."""
        pool = self.pool
        gang = pool.gang
        return (pool.config.on_loss != "end" and gang is not None and gang.sup is not None and gang.sup.keep_peers
                and bool(pool.losses.pending) and bool(gang.sup.live()))

    def refuse_while_waiting(self) -> None:
        """A cell off the notebook's thread cannot mend the pool (a background one): it runs nothing."""
        if self.waiting:
            lost = ", ".join(str(loss.rank) for loss in self.pool.losses.pending)
            raise UsageError(f"rank(s) {lost} of the pool were lost; the pool heals itself between cells (its view "
                             "says when). Nothing ran: run the cell again.")

    def mend(self) -> str:
        """The ranks lost so far mended as ``--on-loss`` says (the ranks held: a cell's turn, or the watch's);
        what to say. A pool that cannot be mended ends, and that is said."""
        pool = self.pool
        gang, policy = pool.gang, pool.config.on_loss
        if not pool.losses.pending or gang.sup is None:
            return ""
        lost = ", ".join(str(loss.rank) for loss in pool.losses.pending)
        if policy != "end" and gang.sup.live() and threading.current_thread() is not threading.main_thread():
            # a background cell's end: no fork beside the notebook's code (background.Turns); the watch, or the
            # next cell, mends it on the notebook's thread
            return f"The pool heals itself ({policy}) before its next cell."
        if policy == "end" or not gang.sup.live() or not gang.sup.keep_peers:
            gang.close("a rank exited")  # (its why: the lost rank's own end, as the pool's view says it)
            why = "--on-loss end" if policy == "end" else "no rank survived"
            return f"The pool has ended and its ranks' state is gone ({why}): %ddp start to begin again."
        pool.view.said(f"{'healing' if policy == 'heal' else 'shrinking'}: rank(s) {lost} lost", mending=True)
        try:
            mended = mend(pool, policy)
        except BaseException as e:  # whatever stopped the mending (an interrupt too) ends the pool
            why = str(e) if isinstance(e, (HealFailed, ReplaceFailed)) else f"{type(e).__name__}: {e}".rstrip(": ")
            gang.close(f"rank(s) {lost} lost, and the pool could not be mended: {why}", as_said=True)
            if not isinstance(e, Exception):
                raise
            return (f"nbddp could not mend the pool: {why}.\nThe pool has ended and its ranks' state is gone: "
                    "%ddp start to begin again.")
        return self.said(mended)

    def said(self, mended: "Mended") -> str:
        """What mending (or resizing) the pool did, in its view; the text the cell says."""
        pool = self.pool
        if mended.joined and not pool.starter.inherits_notebook:
            pool.held.joined_empty()
        elif mended.joined and pool.gang.spans_machines:  # a replacement on another node has none of the notebook
            pool.held.joined_elsewhere()
        text = mended.say(pool.bound_by)
        pool.view.said(text.splitlines()[0])
        for label, names in (("lacking", mended.lacking), ("on the old group", mended.unmade)):
            if names:
                pool.view.said(f"{label}: " + ", ".join(f"{name} ({pool.bound_by.get(name, 'the notebook')})"
                                                        for name in sorted(names)))
        return text

    def between_cells(self) -> None:
        """A loss seen while no cell runs (the watch): mended now, said in the view, and in the next cell."""
        gang = self.pool.gang
        if gang is None or gang.sup is None:
            return
        gang.sup.poll()  # the exit itself: reaped, recorded (Losses), shown
        if self.pool.losses.pending:
            text = self.mend()
            if text and self.pool.alive:
                self.unsaid.append(text)

    def before_cell(self) -> None:
        """A rank lost since the last cell: known now if not yet (no event loop watched it), mended first, and
        what mending said, said here, before the cell's own output."""
        gang = self.pool.gang
        if gang is None or gang.sup is None:
            return
        gang.sup.poll()
        if self.pool.losses.pending:
            text = self.mend()
            if text:
                self.unsaid.append(text)
        place = output.current()
        for text in self.unsaid:
            place.write("stderr", "".join(f"nbddp: {line}\n" if not line.startswith(" ") else f"{line}\n"
                                          for line in text.splitlines()))
        if self.unsaid:
            place.flush("stderr")
        self.unsaid = []

    def resize(self, world_size: int) -> str:
        """``%ddp resize N``: the pool grown or shrunk to ``world_size`` ranks, its state kept."""
        pool = self.pool
        with pool.one_cell():
            self.before_cell()  # (a loss mended first: the pool's size is the one it has now)
            if not pool.alive:
                raise UsageError("%ddp resize: the pool has ended (said above); nothing was resized. %ddp start to "
                                 "begin again.")
            gang = pool.gang
            if world_size == gang.world_size:
                return f"the pool has {world_size} rank(s) already; nothing changed."
            if world_size > gang.world_size and gang.spans_machines and "nccl" in gang.plan.backend:
                raise UsageError("%ddp resize: a pool across Ray nodes on NCCL cannot grow yet (its new ranks "
                                 "take the state as CPU tensors over the group); %ddp restart --nodes N. Nothing "
                                 "changed.")
            # where the new ranks go, found before anything changes (a UsageError changes nothing)
            room = gang.room(world_size - gang.world_size) if world_size > gang.world_size else ()
            pool.view.said(f"resizing: {pool.gang.world_size} → {world_size} ranks")
            try:
                mended = resize(pool, world_size, room)
            except BaseException as e:  # half resized, the pool cannot be vouched for
                why = str(e) if isinstance(e, (HealFailed, ReplaceFailed)) else f"{type(e).__name__}: {e}"
                pool.gang.close(f"torn down: resizing it failed ({why})", as_said=True)
                if not isinstance(e, Exception):
                    raise
                raise RankFailure(f"resizing the pool failed: {why}.\nThe pool has ended and its ranks' state is "
                                  "gone: %ddp start to begin again.", rank=None, cause="resize") from None
            return self.said(mended)


# -- asking some ranks, with a deadline ------------------------------------------------------------------------
ANSWERS = (messages.Result, messages.Error, messages.Exit, messages.Healthy)


class _Answers:
    def __init__(self, ranks, expect=ANSWERS):
        self.ranks = set(ranks)
        self.expect = expect
        self.got: dict[int, object] = {}
        self.lost: list = []

    def on_Message(self, event) -> None:
        rec = event.record
        if event.rank in self.ranks and (isinstance(rec, self.expect) or isinstance(rec, messages.Error)
                                         and rec.phase == "group"):  # (a Regroup that failed)
            self.got.setdefault(event.rank, rec)

    def on_Exited(self, event) -> None:
        if not event.exit.stopped:  # any rank: the step cannot go on without it
            self.lost.append(event.exit)


def ask(gang, commands: dict, what: str, within: float = timeline.STEP_S, also=lambda: True, expect=ANSWERS) -> dict:
    """``commands`` (rank -> command) sent, and each rank's answer (rank -> record, of the kinds ``expect``)
    once every one answered and ``also()`` holds; a rank lost meanwhile, an error, or no answer within
    ``within`` s is HealFailed."""
    answers = _Answers(commands, expect)
    sup = gang.sup
    sup.begin_cell([answers])
    try:
        with starters.sigint_deferred():
            for rank, cmd in commands.items():
                gang.command(cmd, ranks=[rank])
        end = time.monotonic() + within
        sup.wait(None, until=lambda: answers.lost or len(answers.got) == len(commands) and also()
                 or time.monotonic() >= end, wake_at=end)
    except KeyboardInterrupt:
        raise HealFailed(f"interrupted while {what}") from None
    finally:
        sup.end_cell()
    if answers.lost:
        e = answers.lost[0]
        raise HealFailed(f"rank {e.rank} was lost too while {what}: {e.describe()}")
    for rank, rec in sorted(answers.got.items()):
        if isinstance(rec, messages.Error):
            raise HealFailed(f"rank {rank} failed while {what}: {rec.type}: {rec.message}")
        if isinstance(rec, messages.Exit):
            raise HealFailed(f"rank {rank} exited while {what} (sys.exit({rec.code}))")
    missing = sorted(set(commands) - set(answers.got))
    if missing or not also():
        late = f"rank(s) {', '.join(map(str, missing))}" if missing else "a replacement"
        raise HealFailed(f"{late} did not answer within {within:g} s while {what}")
    return answers.got


def call(fn, *args):
    """A command that runs ``fn(ctx, *args)`` on a rank and answers with its value (rank/heal.py's steps)."""
    return messages.Call(values.to_ranks(heal.Step(fn, args, UNLIMITED)))


def value(record):
    return values.loads(record.value.blob) if record.value is not None and record.value.blob is not None else None


# -- the state: which names a replacement may be given -----------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    agreed: list  # names every survivor holds alike (two or more of them)
    remade: list  # of those, what is bound to the group: DDP models, DeviceMeshes, replicated DTensors (made anew)
    lacking: dict  # name -> why the replacement lacks it
    stale: list  # such names on the survivors that no replacement has (bound to the old group until run again)


def verdict(views: dict, fresh: dict | None = None) -> Verdict:
    """What may be copied, from each survivor's survey (rank -> name -> (kind, fingerprint or why, tensors,
    bound by the pool's cells)) and ``fresh``, a new rank's own survey of the notebook's names (a fork of the
    kernel now: what it has without a copy), or None (it has none of them: a forkserver's)."""
    names = sorted(set().union(*views.values())) if views else []
    agreed, remade, lacking, stale = [], [], {}, []
    for name in names:
        seen = [v[name] for v in views.values() if name in v]
        kinds, prints = {x[0] for x in seen}, {x[1] for x in seen}
        why = _notebook_name(name, seen, prints, views, fresh) if not any(x[3] for x in seen) else \
            _pool_name(seen, kinds, prints, views)
        if why == "agreed":
            agreed.append(name)
            if "remade" in kinds:
                remade.append(name)
        elif why:
            lacking[name] = why
    _lacking_with_what_they_share(views, agreed, lacking)
    remade = [n for n in remade if n in agreed]
    stale = [n for n in lacking if any(v.get(n, ("",))[0] in ("remade", "bound") for v in views.values())]
    return Verdict(agreed, remade, lacking, stale)


def _pool_name(seen, kinds, prints, views) -> str:
    """A name the pool's cells bound: copied where two survivors or more agree, else why not."""
    lost = next((x[1] for x in seen if x[0] in ("lost", "bound")), None)
    if lost is not None:
        return lost
    if len(views) < 2:
        return "only one survivor holds it: no second rank can vouch that it is not rank-specific"
    if len(seen) < len(views):
        return "not every survivor holds it"
    if len(prints) > 1:
        return "its value differs between ranks (made from rank)"
    return "agreed"


def _notebook_name(name, seen, prints, views, fresh) -> str:
    """A notebook name the survivors hold: nothing to do where the new rank has it alike; copied where a pool's
    cell changed it in place alike on every survivor; lacking where they changed it differently."""
    if fresh is None or any(x[0] in ("lost", "bound") for x in seen) or len(seen) < len(views):
        return ""
    mine = fresh.get(name)
    if len(prints) == 1 and mine is not None and mine[1] in prints:
        return ""
    if len(prints) > 1:
        return "a pool's cell changed this notebook value in place, differently on each rank"
    if len(views) < 2:
        return ("a pool's cell changed this notebook value in place; only one survivor holds it: no second rank can "
                "vouch that it is not rank-specific")
    return "agreed"


def _lacking_with_what_they_share(views, agreed: list, lacking: dict) -> None:
    """A name that holds tensors a lacking name holds (an optimizer whose model lacks) lacks too: copied alone,
    it would point at parameters the new rank's model does not have."""
    view = next(iter(views.values()), {})
    changed = True
    while changed:
        changed = False
        held = {n: set(view[n][2]) for n in lacking if n in view}
        for name in list(agreed):
            shared = next((other for other, tensors in held.items() if tensors & set(view.get(name, ((),) * 3)[2])),
                          None)
            if shared is not None:
                agreed.remove(name)
                lacking[name] = f"it shares tensors with {shared}, which the new rank lacks"
                changed = True


# -- mending ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Mended:
    how: str  # "healed" | "shrunk"
    lost: list  # the Loss records mended
    seconds: float
    copied: list = dataclasses.field(default_factory=list)
    peer: int | None = None
    lacking: dict = dataclasses.field(default_factory=dict)  # name -> why
    unmade: dict = dataclasses.field(default_factory=dict)  # name -> why: still on the old group, not made anew
    rebuilt: list = dataclasses.field(default_factory=list)
    renumbered: dict = dataclasses.field(default_factory=dict)  # shrink: old rank -> new
    sizes: tuple = (0, 0)  # resize: the world size before and after
    instead: str = ""  # shrunk where --on-loss heal was asked: why it could not heal

    @property
    def joined(self) -> bool:
        """New ranks joined the pool (a replacement, or a pool grown)."""
        return self.how == "healed" or self.how == "resized" and self.sizes[1] > self.sizes[0]

    def say(self, bound_by: dict) -> str:
        """What the cell's output and %ddp status say, with the names to run again and the cells that bound them."""
        ranks = ", ".join(str(loss.rank) for loss in self.lost)
        if self.how == "resized":
            old, new = self.sizes
            took = (f"; rank(s) {units.rank_span(range(old, new))} took {len(self.copied)} name(s) from rank 0"
                    if new > old and self.copied else "")
            lines = [f"resized the pool from {old} to {new} ranks in {self.seconds:.1f} s{took}."]
            ranks = units.rank_span(range(old, new)) if new > old else ""
        elif self.how == "shrunk":
            moves = ", ".join(f"{a}→{b}" for a, b in sorted(self.renumbered.items()) if a != b) or "none"
            lines = [f"shrank the pool in {self.seconds:.1f} s: rank(s) {ranks} gone, the survivors renumbered "
                     f"({moves}) in a new process group of {len(self.renumbered)}."]
            if self.instead:
                lines.insert(0, f"could not heal the pool: {self.instead}; it shrank instead (%ddp resize "
                                f"{len(self.renumbered) + len(self.lost)} grows it back once there is room).")
        else:
            what = f"{len(self.copied)} name(s) from rank {self.peer}" if self.copied else "no names from a peer"
            lines = [f"healed the pool in {self.seconds:.1f} s: a new rank {ranks} took {what} "
                     f"({', '.join(self.copied[:12])}{', ...' if len(self.copied) > 12 else ''})"
                     if self.copied else f"healed the pool in {self.seconds:.1f} s: a new rank {ranks}, {what}."]
        if self.rebuilt:
            lines.append("made anew on the new process group: " + ", ".join(f"{name} ({kind})"
                                                                            for name, kind in self.rebuilt))
        if self.how != "healed":
            lines.append("what a cell made from world_size (a per-rank batch, a scaled learning rate) is as it was on "
                         "every rank: make it again where it matters")
        if self.lacking and self.how == "shrunk" or self.lacking and self.how == "resized" and not ranks:
            lines.append("these names were made from each rank's old number or the old group; run the cells that bound "
                         "them again:")
        elif self.lacking:
            lines.append(f"rank(s) {ranks} lack these names; run the cells that bound them again:")
        if self.lacking:
            lines += _named(self.lacking, bound_by)
        if self.unmade:
            lines.append("these names still use the old process group (they could not be made anew on the new one); "
                         "run the cells that bound them again:")
            lines += _named(self.unmade, bound_by)
        return "\n".join(lines)


def _named(names: dict, bound_by: dict) -> list:
    return [f"  {name} ({bound_by.get(name, 'a cell of the pool')}): {why}" for name, why in sorted(names.items())]


def mend(pool, policy: str) -> Mended:
    """The pool's pending losses mended by ``policy`` ("heal" or "shrink"); HealFailed if it cannot be."""
    gang = pool.gang
    start = time.monotonic()
    settled = start + timeline.SETTLE_S  # losses that come together (the OOM killer's) are mended together
    gang.sup.wait(None, until=lambda: time.monotonic() >= settled, wake_at=settled)
    losses = list(pool.losses.pending)
    survivors = sorted(p.rank for p in gang.sup.live())
    if not survivors:
        raise HealFailed("no rank survived")
    if pool.config.cluster and "nccl" in gang.plan.backend:  # (give/take send CPU tensors over the group)
        raise HealFailed("a pool across Ray nodes on NCCL cannot be mended yet: %ddp restart and re-run the cells "
                         "that build the state")
    if policy == "shrink":
        mended = _shrink(gang, survivors, losses)
    else:
        mended = _heal(gang, survivors, losses, pool.starter.inherits_notebook)
    mended.seconds = time.monotonic() - start
    pool.losses.pending.clear()
    return mended


def _heal(gang, survivors: list, losses: list, inherited: bool) -> Mended:
    """The group first: a survivor still waiting in a collective with the lost rank (or with a peer that left
    it) is freed as the others leave the old group, answers its cell, then joins; then the state."""
    lost = sorted({loss.rank for loss in losses})
    gang.generation += 1
    started = []
    for rank in lost:
        try:
            gang.replace(rank, gang.generation)
        except ReplaceFailed as e:
            if e.started:
                raise
            return _shrunk_instead(gang, survivors, losses, started, f"no new rank {rank} could start ({e})")
        started.append(rank)
    _join(gang, {r: messages.Regroup(gang.generation) for r in survivors}, lost)
    found = _hand_over(gang, survivors, lost, inherited)
    rebuilt, unmade = _rebuild(gang, found.remade)
    return Mended("healed", losses, 0.0, copied=found.agreed, peer=survivors[0], lacking=found.lacking, unmade=unmade,
                  rebuilt=rebuilt)


def _shrunk_instead(gang, survivors: list, losses: list, started: list, why: str) -> Mended:
    """A replacement could not start, before it forked (no memory, no node with the room): the survivors, whole,
    go on, renumbered, rather than end (the replacements already started, waiting for them, killed)."""
    gang.retire(started, kill=True)
    mended = _shrink(gang, survivors, losses)
    mended.instead = why
    return mended


def _hand_over(gang, holders: list, new: list, inherited: bool) -> Verdict:
    """The names ``holders`` agree on, given to the ``new`` ranks by ``holders[0]``: through shared memory on one
    machine; over the process group where the peer and the new ranks may be on different machines (never
    through the kernel's). ``inherited``: the new ranks were forked from the kernel as it is now."""
    if gang.spans_machines:
        found = _survey(gang, holders)
        _over_the_group(gang, holders[0], new, found)
    else:
        found = _survey(gang, holders, new[0] if inherited else None)
        _adopt(gang, new, _export(gang, holders[0], found), found)
    return found


def _survey(gang, holders: list, fresh: int | None = None) -> Verdict:
    """``holders``' fingerprints, and ``fresh``'s (a new rank forked from the kernel: its notebook names as the
    kernel has them now), into a verdict; without ``fresh``, the pool's own names only."""
    commands = {r: call(heal.survey, fresh is not None) for r in holders}
    if fresh is not None:
        commands[fresh] = call(heal.survey, True)
    views = {r: value(rec) for r, rec in ask(gang, commands, "fingerprinting the pool's names").items()}
    mine = views.pop(fresh) if fresh is not None else None
    return verdict(views, mine)


def _export(gang, peer: int, found: Verdict):
    if not found.agreed:
        return None
    return value(ask(gang, {peer: call(heal.export, found.agreed)}, f"rank {peer} sent the pool's names")[peer])


def _over_the_group(gang, peer: int, new: list, found: Verdict) -> None:
    """A pool across machines: the agreed names sent by ``peer`` to the ``new`` ranks over the process group,
    point to point (heal.give, heal.take), never through this machine."""
    commands = {peer: call(heal.give, found.agreed, new)}
    commands.update({r: call(heal.take, peer, sorted(found.lacking)) for r in new})
    ask(gang, commands, f"rank {peer} sent the pool's names over the process group")


def _join(gang, regroups: dict, new: list) -> None:
    """Every rank in the group's new generation: the ranks of ``regroups`` (their late answer to a cell they
    were freed from is not the answer awaited) and the new ones (``Ready``)."""
    ask(gang, regroups, "every rank joined the new process group", within=timeline.JOIN_S,
        also=lambda: all(r in gang.ready for r in new), expect=(messages.Healthy,))


def _adopt(gang, new: list, blob, found: Verdict) -> None:
    if blob is not None or found.lacking:
        ask(gang, {r: call(heal.adopt, blob, sorted(found.lacking)) for r in new}, "the new rank took the names")


def _rebuild(gang, names: list) -> tuple[list, dict]:
    """What is bound to the group under ``names`` (DDP models, DeviceMeshes, replicated DTensors) made anew on
    every rank (collectives, in one order everywhere): (name, kind) each, and name -> why for what could not be
    (a 2-D mesh on a group of another size: run its cell again); with no names, the peer's export is let go
    all the same."""
    answers = ask(gang, {r: call(heal.rebuild, names) for r in range(gang.world_size)},
                  "DDP models and meshes were made anew")
    got = [tuple(x) for x in value(answers[0]) or []]
    return [x for x in got if len(x) == 2], {x[0]: x[2] for x in got if len(x) == 3}


def _shrink(gang, survivors: list, losses: list) -> Mended:
    moves = {old: new for new, old in enumerate(survivors)}
    gang.generation += 1
    gang.renumber(moves)
    _join(gang, {new: gang.regroup_at(new) for new in moves.values()}, [])
    found = _survey(gang, list(moves.values()))
    rebuilt, unmade = _rebuild(gang, [n for n in found.agreed if n in found.remade])
    return Mended("shrunk", losses, 0.0, lacking=_renumbered_lacking(found), unmade=unmade, rebuilt=rebuilt,
                  renumbered=moves)


def _renumbered_lacking(found: Verdict) -> dict:
    """Of a renumbered pool's names (shrunk, resized down), what was made from the old rank, and what still uses
    the old group (a shard)."""
    return {n: why for n, why in found.lacking.items() if "differs" in why or n in found.stale}


def resize(pool, world_size: int, room: tuple = ()) -> Mended:
    """``%ddp resize N``: the pool grown into ``room`` (what ``Gang.room`` found for the new ranks: their devices,
    or a pool across Ray nodes' new nodes; they take the pool's state from rank 0, as a replacement does) or
    shrunk (its highest ranks leave), in a new process group at ``world_size``, DDP models made anew."""
    gang = pool.gang
    old = gang.world_size
    start = time.monotonic()
    ranks = list(range(min(old, world_size)))
    if world_size < old:
        found = _survey(gang, list(range(old)))
        gang.retire(list(range(world_size, old)))
        gang.generation += 1
        gang.renumber({r: r for r in range(world_size)})
        _join(gang, {r: gang.regroup_at(r) for r in ranks}, [])
        mended = Mended("resized", [], 0.0, lacking=_renumbered_lacking(found))
    else:
        new = list(range(old, world_size))
        gang.generation += 1
        gang.grow(world_size, room, gang.generation)
        _join(gang, {r: gang.regroup_at(r) for r in ranks}, new)
        found = _hand_over(gang, ranks, new, pool.starter.inherits_notebook)
        # what uses the old group (a mesh that does not fit the new size, a group of dist.new_group) is stale on
        # the old ranks as well, not lacking on the new ones alone
        mended = Mended("resized", [], 0.0, copied=found.agreed, peer=0,
                        lacking={n: why for n, why in found.lacking.items() if n not in found.stale},
                        unmade={n: found.lacking[n] for n in found.stale})
    mended.rebuilt, unmade = _rebuild(gang, found.remade)
    mended.unmade.update(unmade)
    mended.renumbered = {r: r for r in range(world_size)}
    mended.seconds = time.monotonic() - start
    mended.sizes = (old, world_size)
    return mended


def regrouped(gang) -> list:
    """After a pool's process group was made anew (a stuck collective freed: recovery.py): the DDP models (the
    meshes, the replicated DTensors) every rank holds, made anew on it. Returns (name, kind) each."""
    stale = [set(value(rec) or ()) for rec in ask(gang, {r: call(heal.remade_names) for r in range(gang.world_size)},
                                                    "listing the DDP models and meshes").values()]
    return _rebuild(gang, sorted(set.intersection(*stale)))[0] if stale else []
