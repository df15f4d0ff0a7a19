"""A pool's lost ranks, known at once: ``Losses`` records each rank that died (its number, the cause in words, the
cell it was running, when), and owns the list of those not mended yet, which two threads share; between cells,
``LossWatch`` puts the ranks' pidfds on the kernel's event loop (the main thread, between cells, as the pool's view
redraws), so a rank killed while the pool is idle is known within milliseconds, said in the pool's view and
``%ddp status``, and mended there and then (``Mending.between_cells``); where no event loop runs (a script's
``nbddp.Pool``) the next cell finds it first."""
from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time


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
    """The pool's supervisor's lifelong listener: each rank that ended without being asked to. It owns the one state
    of mending that two threads share, ``pending`` (the losses not mended yet; ``history``: all of them):

    - appended (``on_Exited``) on whichever thread runs the pool's supervisor loop: the notebook's (a blocking cell,
      ``Pool.start``, the watch between cells: ``LossWatch``, on the kernel's event loop) or the background thread
      (a ``--bg`` cell's loop reaps a rank that dies meanwhile);
    - emptied only by mending (``orchestrate.mend``: a snapshot first, ``mended`` at the end), on the notebook's
      thread (a background cell leaves it to the watch or the next cell: ``Mending.mend``);
    - both by the holder of the pool's turn (``Pool.one_cell``, ``Pool.turn_if_free``; ``Pool.start`` aside, which
      no other thread can reach yet), so no other thread appends while a mending runs (a loss its own loop sees
      fails it: ``steps.HealFailed``), and what one holder's loop appended, the next mends (``Mending.before_cell``,
      or the watch, set again as the turn is let go);
    - read without the turn only as a glance that says whether to look again under it: on the event loop by
      ``LossWatch.arm`` (a loss appended while a background cell held the ranks: ``_fired`` mends it, taking the
      turn) and by ``Mending.waiting`` (``Pool.alive``, from any thread). A list's append, clear and truth are each
      atomic under the GIL: a glance may be stale, never torn.
    """

    def __init__(self, view=None):
        self.view = view
        self.pending: list[Loss] = []  # not mended yet
        self.history: list[Loss] = []

    def mended(self) -> None:
        """The pending losses were mended (orchestrate.mend, holding the pool's turn)."""
        self.pending.clear()

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
        # (a glance without the turn: Losses says why it may) lost while a background cell held the ranks: mended
        # now, between cells, by _fired under the turn
        if pool.losses.pending:
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
