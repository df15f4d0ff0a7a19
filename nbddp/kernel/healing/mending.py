"""A pool's side of losing a rank (``%ddp start --on-loss heal|shrink|end``): ``Mending`` acts on the pool's
``--on-loss`` (its gang's ``on_loss``, an options.OnLoss) with the ranks it lost, from a cell's end, the watch
between cells (losses.py) or the next cell's start; ``%ddp resize N``; and what is said of it, in the pool's view and
in the next cell's output. The steps themselves are orchestrate.py's; a pool that cannot be mended ends, saying why."""
from __future__ import annotations

import threading

from ...errors import RankFailure, UsageError
from ...views import output
from ..ranks import keeping
from ..ranks.gang import ReplaceFailed
from . import orchestrate
from .losses import LossWatch
from .report import Mended
from .steps import HealFailed


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
        policy = gang.on_loss if gang is not None else None  # (None until the pool's ranks are up)
        return (policy is not None and policy.mends and gang.sup is not None
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
        gang = pool.gang
        if not pool.losses.pending or gang.sup is None:
            return ""
        policy = gang.on_loss  # (handed to the gang with this method by Pool.start)
        lost = ", ".join(str(loss.rank) for loss in pool.losses.pending)
        if policy.mends and gang.sup.live() and threading.current_thread() is not threading.main_thread():
            # a background cell's end: no fork beside the notebook's code (background.Turns); the watch, or the
            # next cell, mends it on the notebook's thread
            return f"The pool heals itself ({policy.name}) before its next cell."
        if not policy.mends or not gang.sup.live():
            gang.close("a rank exited")  # (its why: the lost rank's own end, as the pool's view says it)
            why = f"--on-loss {policy.name}" if not policy.mends else "no rank survived"
            return f"The pool has ended and its ranks' state is gone ({why}): %ddp start to begin again."
        pool.view.said(f"{policy.doing}: rank(s) {lost} lost", mending=True)
        try:
            with keeping.mending(gang):
                mended = orchestrate.mend(pool, policy)
        except BaseException as e:  # whatever stopped the mending (an interrupt too) ends the pool
            why = str(e) if isinstance(e, (HealFailed, ReplaceFailed)) else f"{type(e).__name__}: {e}".rstrip(": ")
            gang.close(f"rank(s) {lost} lost, and the pool could not be mended: {why}", as_said=True)
            if isinstance(e, Exception):
                return (f"nbddp could not mend the pool: {why}.\nThe pool has ended and its ranks' state is gone: "
                        "%ddp start to begin again.")
            raise
        return self.said(mended)

    def said(self, mended: Mended) -> str:
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
                with keeping.mending(pool.gang):
                    mended = orchestrate.resize(pool, world_size, room)
            except BaseException as e:  # half resized, the pool cannot be vouched for
                why = str(e) if isinstance(e, (HealFailed, ReplaceFailed)) else f"{type(e).__name__}: {e}"
                pool.gang.close(f"torn down: resizing it failed ({why})", as_said=True)
                if not isinstance(e, Exception):
                    raise
                raise RankFailure(f"resizing the pool failed: {why}.\nThe pool has ended and its ranks' state is "
                                  "gone: %ddp start to begin again.", rank=None, cause="resize") from None
            return self.said(mended)
