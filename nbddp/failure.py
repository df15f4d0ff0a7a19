"""How ranks ended, from what their channels said and how their processes exited, as one message a user
can act on; and the timeout report (stacks captured from the ranks' stderr)."""
from __future__ import annotations

import signal
from dataclasses import dataclass

from .channel import PHASES, Error, Exit, Result
from .errors import RankFailure

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
        if self.code == 0:
            return "exited (code 0) before the cell finished: os._exit() or a native exit inside the cell"
        return f"exited with code {self.code} before the cell finished"

    def headline(self) -> str:
        phase = self.phase
        where = f" while {PHASES[phase]}" if phase and phase != "cell" else ""
        if self.left_early:
            return f"rank {self.rank} left early: it {self.describe()} while the other ranks went on"
        return f"rank {self.rank} failed{where}: {self.describe()}"


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


def rank_failed(exits: list[RankExit], relabel: dict[str, str], log_dir: str) -> RankFailure:
    first = root_cause(exits)
    assert first is not None
    lines = [relabel_text(first.headline(), relabel)]
    tb = first.error.traceback if first.error is not None else ""
    if tb:
        lines += ["", relabel_text(tb.rstrip(), relabel)]
    lines.append("")
    for e in sorted(exits, key=lambda e: e.rank):
        if e is first:
            continue
        if e.stopped:
            lines.append(f"rank {e.rank}: stopped by nbddp after rank {first.rank} failed")
        elif failed(e) and e.describe() == first.describe():
            lines.append(f"rank {e.rank} failed the same way")
        elif failed(e) or e.only_leaving:
            lines.append(f"rank {e.rank} also failed (likely a consequence): {e.describe()}")
    lines.append(f"Every rank's full output: {log_dir}")
    return RankFailure("\n".join(lines), rank=first.rank, cause=first.describe())


def notes(exits: list[RankExit], relabel: dict[str, str]) -> list[str]:
    """For a run that succeeded: what still deserves a word (a rank that left early)."""
    out = []
    went_on = any(e.done or e.only_leaving for e in exits)  # exit() on every rank is how a script may end: nothing to say
    for e in exits:
        if e.left_early and went_on:
            out.append(relabel_text(e.headline(), relabel))
        elif e.only_leaving:
            out.append(f"rank {e.rank} finished the cell, then could not leave the process group "
                       f"(a peer had left early): {e.describe()}")
    return out


class StackCapture:
    """Subscribes to the supervisor's events: from a StacksRequested on, keeps each rank's stderr
    (faulthandler writes the stacks there)."""

    def __init__(self):
        self._bytes: dict[int, bytearray] | None = None

    def on_StacksRequested(self, event) -> None:
        self._bytes = {r: bytearray() for r in event.ranks}

    def on_Output(self, event) -> None:
        if self._bytes is not None and event.stream == "stderr" and event.rank in self._bytes:
            self._bytes[event.rank] += event.data

    def stacks(self) -> dict[int, str]:
        return {r: b.decode("utf-8", "replace") for r, b in (self._bytes or {}).items()}


def timed_out(timeout: float, live: list[int], stacks: dict[int, str], relabel, log_dir: str) -> RankFailure:
    lines = [f"--timeout {timeout:g}s expired with rank(s) {', '.join(map(str, live))} still running; all ranks stopped."]
    for r in live:
        stack = stacks.get(r, "").strip()
        lines += ["", f"rank {r} was here:", relabel_text(stack, relabel) if stack else "  (no stack: the rank did not answer)"]
    lines += [
        "",
        "A rank waiting in a collective (all_reduce, barrier) usually means another rank skipped it or took",
        "another branch. Raise --timeout if the work is just slow.",
        f"Every rank's full output: {log_dir}",
    ]
    return RankFailure("\n".join(lines), rank=live[0] if live else None, cause="timeout", stacks=stacks)


def relabel_text(text: str, relabel: dict[str, str]) -> str:
    for filename, label in relabel.items():
        text = text.replace(f'File "{filename}", line', f"{label}, line")
    return text
