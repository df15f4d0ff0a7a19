"""``%ddp``'s verbs for kept pools (``--keep``: ranks that outlive the kernel that started them): ``%ddp pools``,
``%ddp attach [ID]`` (taking.py), ``%ddp detach``, ``%ddp stop ID``, and ``%ddp start`` taking the pool this notebook
kept ("Run All" after a restart). The rest of ``%ddp`` is verbs.py's."""
from __future__ import annotations

import sys
import time

from ..errors import UsageError
from ..views import output
from . import options


class KeptPools:
    """What ``%ddp`` does with kept pools, for the magics ``m`` (their pool, background cells and shell);
    ``stop_pool()``: this kernel's pool stopped (verbs.py's)."""

    def __init__(self, m, stop_pool):
        self.m, self.stop_pool = m, stop_pool

    def to_take(self) -> list:
        """The kept pools no kernel holds, while this kernel has no pool of its own (``%ddp attach`` takes one)."""
        from .ranks import keeping

        if self.m.pool is not None and self.m.pool.alive:
            return []
        return [a for a in keeping.kept() if a.holder_pid is None]

    def took(self, given: dict, rest: str) -> bool:
        """``%ddp start`` while a pool kept from this notebook waits: taken if it was started with the same options
        ("Run All" after a restart), else refused, naming it (nothing started, no device taken twice)."""
        from .ranks import keeping

        mine = keeping.this_notebooks(self.to_take())
        if not mine:
            return False
        wanted = options.line(options.config(given))
        same = next((a for a in mine if a.options == wanted), None)
        if same is None:
            raise UsageError(f"%ddp start {rest.strip()}: a pool kept from this notebook waits, started with other "
                             f"options:\n  {keeping.describe(mine[0])}\nNothing started. %ddp attach {mine[0].pool_id} "
                             f"takes it; %ddp stop {mine[0].pool_id} ends it (then %ddp start again).")
        print("nbddp: %ddp start: a pool kept from this notebook with the same options waits; taking it",
              file=sys.stderr, flush=True)
        self.take(same.pool_id)
        return True

    def pools(self) -> None:
        """``%ddp pools``: this user's kept pools on this machine."""
        from .ranks import keeping

        found = keeping.kept()
        if not found:
            print(f"nbddp: no kept pool (a pool waits {options.KEEP_AUTO_S / 60:g} min for a kernel when its own is "
                  "killed; %ddp start --keep DURATION keeps one across any end of its kernel)")
            return
        print("nbddp: kept pools (%ddp attach ID takes one, %ddp stop ID ends one):")
        for about in found:
            print(f"  {keeping.describe(about)}")

    def take(self, pool_id: str) -> None:
        """``%ddp attach [ID]``: a kept pool taken; without ID, the only one waiting. A --bg cell the last kernel left
        running in its ranks goes on as a background cell of this kernel; another cell it left is waited for."""
        from ..ipy import cells
        from .cells.background import Job
        from .names import delivery
        from .taking import taken

        if self.m.pool is not None and self.m.pool.alive:
            raise UsageError(f"%ddp attach {pool_id}: this kernel runs a pool already; %ddp stop it first. Nothing "
                             "changed.")
        if not pool_id:
            waiting = self.to_take()
            if not waiting:
                raise UsageError("%ddp attach: no kept pool waits for a kernel now (%ddp pools lists them). Nothing "
                                 "changed.")
            if len(waiting) > 1:
                self.pools()
                raise UsageError("%ddp attach: several kept pools wait; say which: %ddp attach ID. Nothing changed.")
            pool_id = waiting[0].pool_id
        t0 = time.monotonic()
        pool, left = taken(self.m.shell.user_ns, pool_id)
        if not left.background:
            left.settle()  # (a cell the notebook was running: interrupted by the keeper as the kernel died)
        self.m.pool, self.m.pool_options = pool, options.line(pool.config)
        print(f"nbddp: took kept pool {pool_id}: {pool.plan.world_size} rank(s) on {pool.plan.accelerator}/"
              f"{pool.plan.backend}, their state as it was, in {time.monotonic() - t0:.2f} s (%ddp stop ends it)",
              flush=True)
        if pool.view.shown:
            pool.show()
        if left.background:  # a --bg training goes on: a background cell of this kernel's from now on
            shell = self.m.shell

            def work(on_start):  # (rank 0's last value shown in the attach cell, as a --bg cell's in its own)
                return delivery.shown_in_place(left.work(on_start), shell)

            def deliver(per_rank):  # its --out/--gather names, here: its ranks' answers carry them, by name
                if not per_rank:
                    return
                outs, gathers = list(per_rank[0].outs), list(per_rank[0].gathers)
                try:
                    delivery.deliver(per_rank, outs, gathers, shell.user_ns, source=None)  # (the kernel before's cell)
                finally:
                    pool.held.came_back([*outs, *gathers])  # (as a --bg cell's: the ranks keep their own values)

            self.m.background.submit(Job(cells.running(shell), f"{left.label} (the kernel before)", work, deliver,
                                         left.brings,
                                         output.Detached(output.kernel_sockets(), output.request_header())),
                                     sent=f"the --bg cell the last kernel left running ({left.label}) goes on as "
                                          "background cell {name}: below, what it printed while no kernel held the "
                                          "pool, then what it prints")

    def detach(self, rest: str) -> None:
        """``%ddp detach``: this kernel's pool handed to its keeper, kept as it is for ``%ddp attach``."""
        from .pool import NO_POOL, detach
        from .ranks import keeping

        if rest:
            raise UsageError(f"%ddp detach takes nothing after it ({rest!r}); nothing changed.")
        if self.m.pool is None:  # (one that ended: pool.detach says so)
            raise UsageError(f"%ddp detach: {NO_POOL}. Nothing changed.")
        pool_id = detach(self.m.pool)
        wait = keeping.keep_seconds(self.m.pool.config.keep) or 0.0
        self.m.pool = None
        print(f"nbddp: pool {pool_id} detached: its ranks and their state kept {wait / 60:g} min with no kernel "
              f"holding it: %ddp attach {pool_id} takes it back (here, or in another kernel of yours: %ddp pools "
              f"lists it), %ddp stop {pool_id} ends it")

    def end(self, pool_id: str) -> None:
        """``%ddp stop ID``: a kept pool no kernel holds, ended (taken, then stopped: a cell running in it too)."""
        from .ranks import keeping
        from .taking import taken

        if self.m.pool is not None and self.m.pool.alive and keeping.pool_id(self.m.pool.run_dir) == pool_id:
            self.stop_pool()
        else:
            taken(None, pool_id)[0].stop()
        print(f"nbddp: kept pool {pool_id} ended")
