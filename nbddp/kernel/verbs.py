"""``%ddp``'s verbs, the line magic ``DDPMagics`` registers (magic.py, whose docstring is ``%ddp?``): a
pool's life (start, stop, restart, status), a look into its ranks (debug, who, diff), and the background
cells (wait, interrupt, attach); kept pools' (pools, attach ID, detach, stop ID) are keptverbs.py's.
The pool they start is the magics' (``DDPMagics.pool``), where every ``%%ddp`` cell finds it."""
from __future__ import annotations

import sys
import time

from ..errors import UsageError
from ..views import output
from . import options
from .keptverbs import KeptPools

INTERRUPT_WAIT_S = 30.0  # %ddp interrupt waits this long for the background cell to end and say how


class Verbs:
    """What ``%ddp VERB ...`` does, for the magics ``m`` (their pool, background cells and shell)."""

    def __init__(self, m):
        self.m = m
        self.kept = KeptPools(m, self._stop_pool)  # attach ID, detach, pools, stop ID

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
            return self.kept.pools()
        if verb == "attach" and (rest.strip() or self.kept.to_take()):
            return self.kept.take(rest.strip())
        if verb in ("wait", "interrupt", "attach"):
            return self._background(verb, rest.strip())
        self.m.background.before_foreground(f"%ddp {verb}")  # never two cells in the ranks at once
        if verb in ("debug", "who", "diff"):
            with self.m.ranks_debug_themselves():
                return self._look(verb, rest.strip())
        if verb == "stop" and rest.strip():
            return self.kept.end(rest.strip())
        if verb == "detach":
            return self.kept.detach(rest.strip())
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
        if verb == "start" and self.kept.took(given, rest):
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


