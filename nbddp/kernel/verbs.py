"""``%ddp``'s verbs, the line magic ``DDPMagics`` registers (magic.py, whose docstring is ``%ddp?``): a
pool's life (start, stop, restart, status), a look into its ranks (debug, who, diff), and the background
cells (wait, interrupt, attach). The pool they start is the magics' (``DDPMagics.pool``), where every
``%%ddp`` cell finds it."""
from __future__ import annotations

import os
import sys
import time

from ..errors import UsageError
from ..views import output
from . import options

INTERRUPT_WAIT_S = 30.0  # %ddp interrupt waits this long for the background cell to end and say how


class Verbs:
    """What ``%ddp VERB ...`` does, for the magics ``m`` (their pool, background cells and shell)."""

    def __init__(self, m):
        self.m = m

    def run(self, line: str):
        from .pool import NO_POOL

        verb, _, rest = line.strip().partition(" ")
        verb = verb or "status"
        if verb == "status":
            if self.m.pool is not None and self.m.pool.alive and self.m.pool.view.shown:
                self.m.pool.show()  # the pool's live dashboard, once more (the same output id)
            else:
                print(self.m.pool.status() if self.m.pool is not None else NO_POOL)
            work = self.m.background.status()
            if work:
                print("background cells:\n" + "\n".join(f"  {line}" for line in work))
            return
        if verb == "pools":
            return self._pools()
        if verb == "attach" and (rest.strip() or self._kept_to_take()):
            return self._take(rest.strip())
        if verb in ("wait", "interrupt", "attach"):
            return self._background(verb, rest.strip())
        self.m.background.before_foreground(f"%ddp {verb}")  # never two cells in the ranks at once
        if verb in ("debug", "who", "diff"):
            with self.m.ranks_debug_themselves():
                return self._look(verb, rest.strip())
        if verb == "stop" and rest.strip():
            return self._end_kept(rest.strip())
        if verb == "detach":
            return self._detach(rest.strip())
        if verb == "stop":
            ended = self.m.pool.ended if self.m.pool is not None else None
            if self._stop_pool():
                print(f"nbddp: the pool had already ended ({ended}); %%ddp cells are one-shot again" if ended else
                      "nbddp: pool stopped; %%ddp cells are one-shot again")
            else:
                print("nbddp: no pool is running")
            return
        if verb in ("start", "restart"):
            return self._start(verb, rest)
        if verb == "resize":
            return self._resize(rest.strip())
        raise UsageError(f"%ddp {verb}: say start [options], stop [ID], restart [options], resize N, status, debug "
                         "[RANK], who, diff EXPR, wait [--timeout S], interrupt, attach [ID], detach or pools.")

    # -- kept pools (--keep): ranks that outlived the kernel that started them ---------------------------------------
    def _kept_to_take(self) -> list:
        """The kept pools no kernel holds, while this kernel has no pool of its own (``%ddp attach`` takes one)."""
        from .ranks import keeping

        if self.m.pool is not None and self.m.pool.alive:
            return []
        return [a for a in keeping.kept() if a.holder_pid is None]

    def _took_kept(self, given: dict, rest: str) -> bool:
        """``%ddp start`` while a pool kept from this notebook waits: taken if it was started with the same options
        ("Run All" after a restart), else refused, naming it (nothing started, no device taken twice)."""
        from .ranks import keeping

        notebook = os.environ.get("JPY_SESSION_NAME", "")  # (Jupyter's: without it, no pool is known as this one's)
        mine = [a for a in self._kept_to_take() if a.notebook == notebook] if notebook else []
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
        self._take(same.pool_id)
        return True

    def _pools(self) -> None:
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

    def _take(self, pool_id: str) -> None:
        """``%ddp attach [ID]``: a kept pool taken; without ID, the only one waiting."""
        from .pool import taken

        if self.m.pool is not None and self.m.pool.alive:
            raise UsageError(f"%ddp attach {pool_id}: this kernel runs a pool already; %ddp stop it first. Nothing "
                             "changed.")
        if not pool_id:
            waiting = self._kept_to_take()
            if not waiting:
                raise UsageError("%ddp attach: no kept pool waits for a kernel now (%ddp pools lists them). Nothing "
                                 "changed.")
            if len(waiting) > 1:
                self._pools()
                raise UsageError("%ddp attach: several kept pools wait; say which: %ddp attach ID. Nothing changed.")
            pool_id = waiting[0].pool_id
        t0 = time.monotonic()
        pool = taken(self.m.shell.user_ns, pool_id)
        self.m.pool, self.m.pool_options = pool, options.line(pool.config)
        print(f"nbddp: took kept pool {pool_id}: {pool.plan.world_size} rank(s) on {pool.plan.accelerator}/"
              f"{pool.plan.backend}, their state as it was, in {time.monotonic() - t0:.2f} s (%ddp stop ends it)",
              flush=True)
        if pool.view.shown:
            pool.show()

    def _detach(self, rest: str) -> None:
        """``%ddp detach``: this kernel's pool handed to its keeper, kept as it is for ``%ddp attach``."""
        from .pool import NO_POOL, detach
        from .ranks import keeping

        if rest:
            raise UsageError(f"%ddp detach takes nothing after it ({rest!r}); nothing changed.")
        if self.m.pool is None or not self.m.pool.alive:
            raise UsageError(f"%ddp detach: {NO_POOL}. Nothing changed.")
        pool_id = detach(self.m.pool)
        wait = keeping.keep_seconds(self.m.pool.config.keep) or 0.0
        self.m.pool = None
        print(f"nbddp: pool {pool_id} detached: its ranks and their state kept {wait / 60:g} min with no kernel "
              f"holding it: %ddp attach {pool_id} takes it back (here, or in another kernel of yours: %ddp pools "
              f"lists it), %ddp stop {pool_id} ends it")

    def _end_kept(self, pool_id: str) -> None:
        """``%ddp stop ID``: a kept pool no kernel holds, ended (taken, then stopped)."""
        from .pool import taken
        from .ranks import keeping

        if self.m.pool is not None and self.m.pool.alive and keeping.pool_id(self.m.pool.run_dir) == pool_id:
            self._stop_pool()
        else:
            taken(None, pool_id).stop()
        print(f"nbddp: kept pool {pool_id} ended")

    def _resize(self, rest: str) -> None:
        """``%ddp resize N``: the running pool grown or shrunk to N ranks, its state kept (healing/mending.py)."""
        from .pool import NO_POOL

        if not rest.isdigit() or int(rest) < 1:
            raise UsageError(f"%ddp resize {rest}: give the new number of ranks, a whole number >= 1 (%ddp resize 4). "
                             "Nothing changed.")
        if self.m.pool is None or not self.m.pool.alive:
            raise UsageError(f"%ddp resize: {NO_POOL}. Nothing changed.")
        print(f"nbddp: {self.m.pool.mending.resize(int(rest))}")

    def _start(self, verb: str, rest: str) -> None:
        """``%ddp start [options]``, ``%ddp restart [options]``: a new pool, the running one stopped only once
        the new one's options are checked."""
        from .pool import Pool

        if verb == "start" and self.m.pool is not None and self.m.pool.alive:
            raise UsageError("a pool is already running: %ddp restart [options] re-forks it, %ddp stop ends it.")
        rest = rest or (self.m.pool_options if verb == "restart" else "")
        given, names = options.split(options.parse(rest))
        if names:
            flags = " and ".join(options.BY_NAME[n].flag for n in names)
            raise UsageError(f"%ddp {verb}: {flags} {'belongs' if len(names) == 1 else 'belong'} to one %%ddp "
                             "cell (--out and --gather bring values back from it, --ranks picks its ranks); "
                             "give it on that cell.\n"
                             "Nothing ran" + (", and the running pool is as it was." if self.m.pool is not None
                                              else "."))
        if verb == "start" and self._took_kept(given, rest):
            return
        pool = Pool(self.m.shell.user_ns, **given)
        pool.check()  # bad options, spawn: refused while the running pool stays
        self._stop_pool()
        t0 = time.monotonic()
        pool.start()  # devices planned now: the old pool's GPUs are free
        self.m.pool, self.m.pool_options = pool, rest
        print(f"nbddp: pool of {pool.plan.world_size} rank(s) on {pool.plan.accelerator}/{pool.plan.backend} "
              f"ready in {time.monotonic() - t0:.2f} s (%ddp stop ends it)", flush=True)
        if pool.view.shown:
            pool.show()  # its dashboard, below that line, live for the pool's life

    def _background(self, verb: str, rest: str):
        """``%ddp wait [--timeout S]``, ``%ddp interrupt``, ``%ddp attach``: background cells (background.py)."""
        work = self.m.background
        if verb == "wait":
            timeout = _wait_timeout(rest)
            if not work.jobs:
                print("nbddp: no background cell has run (%%ddp --bg sends one)")
            return work.wait(timeout)
        if rest:
            raise UsageError(f"%ddp {verb} takes nothing after it; nothing was done.")
        if verb == "attach":
            job = work.attach(output.request_header())
            if job is None:
                print("nbddp: no background cell to attach to (%%ddp --bg sends one)")
            elif job.done.is_set():
                print(f"nbddp: background cell {job.name} ended ({job.state}); above is what it showed",
                      file=sys.stderr)
            return None
        running = work.interrupt()
        if running is None:
            print("nbddp: no background cell is running; nothing was interrupted")
            return None
        print(f"nbddp: interrupting background cell {running.name}: its report arrives in its own output",
              file=sys.stderr)
        sys.stderr.flush()
        if running.done.wait(INTERRUPT_WAIT_S):
            work.land(quiet_failures=True)
            running.raised = True  # asked for: not a failure %ddp wait raises
            print(f"nbddp: {running.describe()}" + (f"; {running.fate}" if running.fate else ""), file=sys.stderr)
        else:
            print(f"nbddp: {running.name} has not ended within {INTERRUPT_WAIT_S:g} s; %ddp status shows it, "
                  "%ddp interrupt again tears it down.", file=sys.stderr)
        return None

    def _look(self, verb: str, rest: str):
        """``%ddp debug [RANK]``, ``%ddp who``, ``%ddp diff EXPR``: into the pool's ranks."""
        if self.m.pool is None or not self.m.pool.alive:
            raise UsageError(f"%ddp {verb} looks into a running pool's ranks, and " +
                             (f"the pool has ended ({self.m.pool.ended})."
                              if self.m.pool is not None and self.m.pool.ended
                              else "no pool is running.") + " %ddp start [options] starts one.")
        if verb == "debug":
            if rest and not rest.isdigit():
                raise UsageError(f"%ddp debug {rest}: give a rank number (%ddp debug 1), or none for the rank "
                                 "that failed last.")
            return self.m.pool.debug(int(rest) if rest else None)
        from .names.survey_tables import diff, who

        if verb == "who":
            return who(self.m.pool)
        if not rest:
            raise UsageError("%ddp diff EXPR: say what to compare across ranks, e.g. %ddp diff model.state_dict()")
        return diff(self.m.pool, rest)

    def _stop_pool(self) -> bool:
        if self.m.pool is None:
            return False
        self.m.pool.stop()
        self.m.pool = None
        return True


def _wait_timeout(rest: str) -> float | None:
    """``%ddp wait``'s ``--timeout S``; bad input is a usage error (nothing waited for)."""
    parts = rest.replace("=", " ").split()
    if not parts:
        return None
    if len(parts) == 2 and parts[0] in ("--timeout", "-t"):
        try:
            value = float(parts[1])
        except ValueError:
            value = -1.0
        if value > 0:
            return value
    raise UsageError(f"%ddp wait {rest}: say %ddp wait, or %ddp wait --timeout SECONDS (a number > 0); "
                     "nothing was waited for.")


