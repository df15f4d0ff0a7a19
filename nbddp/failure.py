"""Turning how ranks ended into one message a user can act on."""
from __future__ import annotations

import signal
from dataclasses import dataclass

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
    rank: int
    code: int | None  # as os.waitstatus_to_exitcode: negative = killed by that signal
    message: dict | None  # what the rank sent over its result pipe, if anything
    stopped: bool = False  # nbddp stopped it because another rank failed / interrupt / timeout
    order: int = 0  # order in which the parent saw it end
    max_rss: int = 0  # peak resident set size in bytes, from wait4
    seen: float = float("inf")  # time.time() when the parent saw it end

    @property
    def ok(self) -> bool:
        return self.code == 0 and bool(self.message) and self.message.get("ok", False)

    @property
    def when(self) -> float:
        """When it failed: the rank's own timestamp, else (a signal, a silent exit) when the parent saw it."""
        return (self.message or {}).get("time", self.seen)

    @property
    def peer_lost(self) -> bool:
        """A collective that failed because a peer went away: a consequence, never the cause."""
        m = self.message or {}
        return m.get("kind") == "exception" and any(p in m.get("message", "") for p in PEER_LOST)

    def describe(self) -> str:
        m = self.message or {}
        if m.get("kind") == "exception":
            return f"{m['type']}: {m['message']}"
        if m.get("kind") == "exit":
            return f"called sys.exit({m['code']}) before the cell finished"
        if m.get("kind") == "result":
            return f"its return value ({m['type']}) cannot be pickled: {m['message']}"
        if self.code is not None and self.code < 0:
            sig = signal.Signals(-self.code)
            return f"killed by {sig.name}: {SIGNAL_HINTS.get(sig, '')}".rstrip(": ")
        if self.code == 0:
            return "exited (code 0) before the cell finished: os._exit() or a native exit inside the cell"
        return f"exited with code {self.code} before the cell finished"


def root_cause(exits: list[RankExit]) -> RankExit | None:
    """The failure that came first, errors that only say "my peer went away" last: a rank killed by
    SIGSEGV is seen by the parent after its peer's collective already raised "Connection closed"."""
    failed = [e for e in exits if not e.ok and not e.stopped]
    if not failed:
        return None
    return min(failed, key=lambda e: (e.peer_lost, e.when, e.order))


def rank_failed(exits: list[RankExit], relabel: dict[str, str], log_dir: str) -> RankFailure:
    first = root_cause(exits)
    assert first is not None
    lines = [f"rank {first.rank} failed: {first.describe()}"]
    tb = (first.message or {}).get("traceback")
    if tb:
        lines += ["", _relabel(tb.rstrip(), relabel)]
    lines.append("")
    for e in sorted(exits, key=lambda e: e.rank):
        if e is first:
            continue
        if e.stopped:
            lines.append(f"rank {e.rank}: stopped by nbddp after rank {first.rank} failed")
        elif not e.ok and e.describe() == first.describe():
            lines.append(f"rank {e.rank} failed the same way")
        elif not e.ok:
            lines.append(f"rank {e.rank} also failed (likely a consequence): {e.describe()}")
    lines.append(f"Every rank's full output: {log_dir}")
    return RankFailure("\n".join(lines), rank=first.rank, cause=first.describe())


def timed_out(timeout: float, live: list[int], stacks: dict[int, str], relabel, log_dir: str) -> RankFailure:
    lines = [f"--timeout {timeout:g}s expired with rank(s) {', '.join(map(str, live))} still running; all ranks stopped."]
    for r in live:
        stack = stacks.get(r, "").strip()
        lines += ["", f"rank {r} was here:", _relabel(stack, relabel) if stack else "  (no stack: the rank did not answer)"]
    lines += [
        "",
        "A rank waiting in a collective (all_reduce, barrier) usually means another rank skipped it or took",
        "another branch. Raise --timeout if the work is just slow.",
        f"Every rank's full output: {log_dir}",
    ]
    return RankFailure("\n".join(lines), rank=live[0] if live else None, cause="timeout", stacks=stacks)


def _relabel(text: str, relabel: dict[str, str]) -> str:
    for filename, label in relabel.items():
        text = text.replace(f'File "{filename}", line', f"{label}, line")
    return text
