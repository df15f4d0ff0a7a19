"""How ranks ended, from what their channels said and how their processes exited, as one message a user
can act on; the timeout report (stacks captured from the ranks' stderr) and the interrupt message."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ... import errors
from ...errors import RankFailure
from ...ipy import tracebacks
from ...units import ranks_text
from ...wire.messages import PHASES, Done, Error, Exit, Result

# what gloo and NCCL raise in a collective when another rank died or left
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted", "remote process exited or there was a network error")

SIGNAL_HINTS = {
    signal.SIGKILL: "killed outright: most often the kernel's out-of-memory killer (see `dmesg`), "
    "or a `kill -9`. Use fewer ranks, smaller batches, or free memory in the notebook.",
    signal.SIGSEGV: "a crash in native code (a C/C++ extension or a driver). faulthandler's Python "
    "stack for the crash is in the rank's output above.",
    signal.SIGBUS: "often /dev/shm too small for DataLoader workers: use num_workers=0, or a larger "
    "/dev/shm (docker --shm-size).",
    signal.SIGABRT: "aborted by native code (an assertion, or an NCCL/CUDA error).",
    signal.SIGTERM: "terminated by another process.",
}


@dataclass
class RankExit:
    """A rank's end: its exit status and the channel records that tell how it got there."""

    rank: int
    code: int | None  # as os.waitstatus_to_exitcode: negative = killed by that signal
    error: Error | None = None
    left: Exit | None = None  # the rank's own sys.exit()/exit()
    result: Result | None = None
    done: bool = False  # finished the job and left the group
    stopped: bool = False  # nbddp stopped it because another rank failed / interrupt / timeout
    order: int = 0  # order in which the parent saw it end
    max_rss: int = 0  # peak resident set size in bytes, from wait4
    seen: float = float("inf")  # time.time() when the parent saw it end
    node: str = ""  # a cluster pool's: the node it ran on (failures name it)

    @property
    def where(self) -> str:
        return f" on node {self.node}" if self.node else ""

    @property
    def ok(self) -> bool:
        """Ended as a script may: the job finished, or the rank's own code exited with 0."""
        return self.code == 0 and (self.done or (self.left is not None and self.left.code == 0))

    @property
    def left_early(self) -> bool:
        return self.ok and not self.done

    @property
    def only_leaving(self) -> bool:
        """The job finished and its results were sent; only leaving the group failed (a peer left first)."""
        return self.error is not None and self.error.phase == "leave" and self.result is not None

    @property
    def when(self) -> float:
        """When it failed: the rank's own timestamp, else (a signal, a silent exit) when the parent saw it."""
        for rec in (self.error, self.left):
            if rec is not None:
                return rec.time
        return self.seen

    @property
    def peer_lost(self) -> bool:
        """A collective that failed because a peer went away: a consequence, never the cause."""
        return self.error is not None and any(p in self.error.message for p in PEER_LOST)

    @property
    def phase(self) -> str | None:
        rec = self.error or self.left
        return rec.phase if rec is not None else None

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.error.type}: {self.error.message}"
        if self.left is not None:
            at = f" at {self.left.where}" if self.left.where else ""
            return f"called sys.exit({self.left.code}){at}"
        if self.code is not None and self.code < 0:
            sig = signal.Signals(-self.code)
            return f"killed by {sig.name}: {SIGNAL_HINTS.get(sig, '')}".rstrip(": ")
        if self.code is None:
            return ("ended; how is unknown (a rank of a kept pool, taken by this kernel: not its child); its last "
                    "words are in its log")
        if self.code == 0:
            return "exited (code 0) before the cell finished: os._exit() or a native exit inside the cell"
        return f"exited with code {self.code} before the cell finished"

    def headline(self) -> str:
        phase = self.phase
        where = f" while {PHASES[phase]}" if phase and phase != "cell" else ""
        if self.left_early:
            return f"rank {self.rank}{self.where} left early: it {self.describe()} while the other ranks went on"
        return f"rank {self.rank}{self.where} failed{where}: {self.describe()}"


def exit_record(rank: int, records: dict, *, code: int | None, stopped: bool, **more) -> RankExit:
    """A rank's exit record, from the last record of each kind it sent (``records``: class -> record)
    and its exit code (a pool's rank that answered a cell: 0 for a Result, 1 for an Error). ``stopped``:
    nbddp ended it (a signal, or its interrupt); it counts only if the rank did not end on its own first
    (an interrupt's own KeyboardInterrupt aside)."""
    error, left, done = records.get(Error), records.get(Exit), Done in records
    by_nbddp = stopped and left is None and not done and (error is None or error.type == "KeyboardInterrupt")
    return RankExit(rank, code, error=error, left=left, result=records.get(Result), done=done, stopped=by_nbddp, **more)


def failed(e: RankExit) -> bool:
    """Counts against the run: not ok, not stopped by nbddp, and more than a peer's early leave."""
    return not e.ok and not e.stopped and not e.only_leaving


def root_cause(exits: list[RankExit]) -> RankExit | None:
    """The failure that came first, errors that only say "my peer went away" last: a rank killed by
    SIGSEGV is seen by the parent after its peer's collective already raised "Connection closed".
    If the best a run has is such an error and a rank left early, the early leave is the cause."""
    bad = [e for e in exits if failed(e)]
    if not bad:
        return None
    first = min(bad, key=lambda e: (e.peer_lost, e.when, e.order))
    early = [e for e in exits if e.left_early]
    if first.peer_lost and early:
        return min(early, key=lambda e: e.when)
    return first


def rank_failed(exits: list[RankExit], relabel, log_dir: str) -> RankFailure:
    first = root_cause(exits)
    assert first is not None
    lines = [tracebacks.relabel(first.headline(), relabel)]
    tb = first.error.traceback if first.error is not None else ""
    if tb:
        lines += ["", tracebacks.relabel(tb.rstrip(), relabel)]
    lines.append("")
    said: dict[str, list[int]] = {}  # what the others did -> which ranks (one line each, however many ranks)
    for e in sorted(exits, key=lambda e: e.rank):
        if e is first:
            continue
        if e.stopped:
            said.setdefault(f": stopped by nbddp after rank {first.rank} failed", []).append(e.rank)
        elif failed(e) and e.describe() == first.describe():
            said.setdefault(" failed the same way", []).append(e.rank)
        elif failed(e) or e.only_leaving:
            said.setdefault(f" also failed (likely a consequence): {e.describe()}", []).append(e.rank)
    lines += [f"{ranks_text(ranks)}{what}" for what, ranks in said.items()]
    lines.append(f"Every rank's full output: {log_dir}")
    return RankFailure("\n".join(lines), rank=first.rank, cause=first.describe())


def notes(exits: list[RankExit], relabel) -> list[str]:
    """For a run that succeeded: what still deserves a word (a rank that left early)."""
    out = []
    # exit() on every rank is how a script may end: nothing to say
    went_on = any(e.done or e.only_leaving for e in exits)
    for e in exits:
        if e.left_early and went_on:
            out.append(tracebacks.relabel(e.headline(), relabel))
        elif e.only_leaving:
            out.append(f"rank {e.rank} finished the cell, then could not leave the process group "
                       f"(a peer had left early): {e.describe()}")
    return out


def timed_out(timeout: float, live: list[int], stacks: dict[int, str], relabel, log_dir: str,
              fate: str = "all ranks stopped") -> RankFailure:
    lines = [f"--timeout {timeout:g}s expired with {ranks_text(live)} still running; {fate}."]
    places: dict[tuple, list[int]] = {}  # ranks stuck at the same place are shown once
    for r in live:
        shown = _stack_lines(stacks.get(r, ""), relabel, r, log_dir)
        places.setdefault(tuple(shown[:-1]) + (shown[-1].replace(f"rank{r}.log", "rankN.log"),), []).append(r)
    for shown, ranks in places.items():
        was = "was" if len(ranks) == 1 else "were"
        last = shown[-1] if len(ranks) > 1 else shown[-1].replace("rankN.log", f"rank{ranks[0]}.log")
        lines += ["", f"{ranks_text(ranks)} {was} here:", *shown[:-1], last]
    lines += [
        "",
        "A rank waiting in a collective (all_reduce, barrier) usually means another rank skipped it or took",
        "another branch. Raise --timeout if the work is just slow.",
        f"Every rank's full output: {log_dir}",
    ]
    return RankFailure("\n".join(lines), rank=live[0] if live else None, cause="timeout", stacks=stacks)


AWAITING = "a coroutine's frames are not on the stack while it waits"


def _stack_lines(dump: str, relabel, rank: int, log_dir: str) -> list[str]:
    if not dump.strip():
        return ["  (no stack: the rank did not answer)"]
    log = os.path.join(log_dir, f"rank{rank}.log")
    frames = tracebacks.user_stack(dump, relabel)
    if frames:
        return frames + [f"  (most recent call first; every thread's whole stack is in {log})"]
    if tracebacks.awaiting(tracebacks.main_thread(dump)):
        return [f"  (waiting in an `await` of the cell: {AWAITING}; every thread's whole stack is in {log})"]
    return [f"  (not in the cell's code: only nbddp's frames; every thread's whole stack is in {log})"]


def interrupted(running: list[int], states: dict[int, str], log_dir: str, fate: str) -> KeyboardInterrupt:
    """What the notebook shows after an interrupt while ranks ran: which ranks were running and where
    each was in the user's code (``states``: "was at Cell In[4], line 2, in f: ..."), instead of a
    traceback through nbddp's wait loop. Still a KeyboardInterrupt."""
    head = f"interrupted while rank(s) {ranks_text(running, word=False)} ran the cell" if running else "interrupted"
    where: dict[str, list[int]] = {}
    for r in running:
        if r in states:
            where.setdefault(states[r], []).append(r)
    lines = [f"{head}; {fate}."] + [f"{ranks_text(ranks)} {_plural(state) if len(ranks) > 1 else state}"
                                    for state, ranks in where.items()]
    lines.append(f"Every rank's full output: {log_dir}")
    return errors.interrupt("\n".join(lines))


def _plural(state: str) -> str:
    return "were " + state[4:] if state.startswith("was ") else state


def alone(stuck: dict[int, tuple[str, str]], finished: list[int], log_dir: str, idle=()) -> RankFailure:
    """Ranks waiting in a torch.distributed collective that every other rank finished the cell without
    calling (``stuck``: rank -> (the collective, where the rank was)); ``idle``: a pool's ranks the cell
    was not sent to (--ranks)."""
    lines = []
    for rank, (name, where) in sorted(stuck.items()):
        others = [f"{ranks_text(finished)} finished the cell without joining it"] if finished else []
        does = "does" if len(idle) == 1 else "do"
        others += [f"{ranks_text(idle)} {does} not run this cell (--ranks)"] if idle else []
        lines.append(f"rank {rank} waits in torch.distributed.{name}, but {' and '.join(others)}: a collective that "
                     "only some ranks call never completes.")
        lines.append(f"  rank {rank} {where}")
    lines.append("A cell on some ranks (--ranks) is for looking and local work; nbddp stopped waiting. Run "
                 "collectives in a cell on every rank." if idle else
                 "Under torchrun the finished ranks would exit and this collective would fail at once; nbddp "
                 "stopped waiting. Call the collective on every rank of the group (or on none).")
    lines.append(f"Every rank's full output: {log_dir}")
    return RankFailure("\n".join(lines), rank=min(stuck), cause="collective")


def was_at(frames: list, relabel, otherwise: str) -> str:
    """``frames``: a rank's stack, most recent first (tracebacks.main_thread, traceback_frames)."""
    at = tracebacks.where(frames, relabel)
    if at:
        return f"was at {at}"
    return f"was waiting in an `await` of the cell ({AWAITING})" if tracebacks.awaiting(frames) else otherwise


# -- what became of a pool, said at the end of its cell's failure or interrupt ---------------------------
REWRAP = "a DistributedDataParallel model would be: model = DDP(model.module)"


def pool_fate(survived: bool, regrouped=(), old_group_users=(), rebuilt=()) -> str:
    """The line a pool's failed cell ends with: whether the pool and its state live on, and (after a
    fresh process group) what was made anew on it (``rebuilt``: (name, kind) each) and what must be made again."""
    if survived and regrouped:
        made = (" Made anew on it: " + ", ".join(
            f"{name} ({kind}{', same module and options' if kind == 'DistributedDataParallel' else ''})"
            for name, kind in rebuilt) + "." if rebuilt else "")
        bound = (f" Make again what else was bound to the old group before the next step: "
                 f"{'; '.join(sorted(old_group_users))}." if old_group_users else "")
        return ("The pool and its state survived, and its process group was made anew: rank(s) "
                f"{ranks_text(regrouped, word=False)} waited in a collective that could only be ended by "
                f"leaving the old group.{made}{bound} Tensors, optimizers and everything else are as they were.")
    if survived:
        return "The pool and its state survived: fix the cell and run it again."
    return ("The pool was torn down (a rank did not come back from a collective), and its ranks' state "
            "with it: %ddp start to begin again.")


def interrupt_fate(survived: bool, regrouped=(), rebuilt=()) -> str:
    """What became of a pool after Jupyter's interrupt, for ``interrupted``."""
    if survived and regrouped:
        made = f" ({', '.join(f'{name}: {kind}' for name, kind in rebuilt)} made anew on it)" if rebuilt else ""
        return ("the pool and its state survived; its process group was made anew to free rank(s) "
                f"{ranks_text(regrouped, word=False)} from a collective{made}")
    if survived:
        return "every rank stopped its cell; the pool and its state survived"
    return ("the pool was torn down (a rank did not stop its cell), and its ranks' state with it: "
            "%ddp start to begin again")


def old_group_hint(cause: RankExit | None, old_group) -> str:
    """A pool whose process group was made anew (``old_group``: what the ranks had bound to the old group,
    or None if it never was): a later cell failing because a peer "went away" most often still uses an
    object of the old group. Said again at each such failure, not only the first."""
    if cause is None or not cause.peer_lost or old_group is None:
        return ""
    what = "; ".join(old_group) if old_group else REWRAP
    return ("This pool's process group was made anew after an earlier cell was stopped in a collective; an "
            f"object made before that still uses the old group and fails this way. Make it again: {what}.")


def reply_states(running: list[int], replies: dict, relabel) -> dict[int, str]:
    """Where each interrupted rank of a pool was: its KeyboardInterrupt's traceback (user frames only)."""
    states = {}
    for r in running:
        rec = replies.get(r)
        if isinstance(rec, Error) and rec.type == "KeyboardInterrupt":
            states[r] = was_at(tracebacks.traceback_frames(rec.traceback), relabel,
                               "stopped (not in the cell's code, or waiting in an `await`)")
        elif isinstance(rec, Error):
            states[r] = f"failed: {rec.type}: {rec.message}"
        elif rec is None:
            states[r] = "did not stop its cell (stuck in native code or in a collective)"
        else:
            states[r] = "finished its cell as the interrupt came"
    return states
