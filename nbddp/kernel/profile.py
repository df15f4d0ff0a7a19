"""``--profile``, kernel side: the ranks' summaries (rank/profile_session.py, each with its ``Result``) combined into
one profile once every rank has answered, shown in the cell (views/profile_chart.py), and kept for
``nbddp.profile()``.

Waiting is worked out here, the only place that has every rank's collectives: collective i of each rank
(in order of issue) is matched with collective i of the others; the last rank to enter it arrived at
``latest``; a rank that entered at ``start`` waited ``min(duration, max(0, latest - start))`` for it (the
starts are on time.time()'s clock, which each rank put its profiler's on at its start mark).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from ..rank.profile_session import covered
from ..wire import messages

COLUMNS = ("rank", "steps", "step_s", "compute_s", "comm_s", "wait_s", "data_s", "other_s")

_last = None  # the last Profile shown, for nbddp.profile()


@dataclass
class Profile:
    rows: list  # per rank: dict of COLUMNS
    traces: list  # each rank's trace file
    waited: dict = field(default_factory=dict)  # rank -> Counter((collective, the rank it waited for) -> seconds)
    problems: list = field(default_factory=list)  # "rank 1: ..." (a rank with nothing profiled)
    asked: int = 0  # the steps --profile asked for
    verdict: str = ""  # one line: the slowest rank and why (``verdict``)

    def frame(self):
        import pandas as pd

        return pd.DataFrame([[row[c] for c in COLUMNS] for row in self.rows], columns=list(COLUMNS))


def asked(command, config, folder):
    """``command`` with ``--profile``'s request, a cell's (``RunCell``) only; unchanged without it."""
    steps = getattr(config, "profile", None)
    if steps is None or not isinstance(command, messages.RunCell):
        return command
    return dataclasses.replace(command, profile=(int(steps), str(folder)))


def combine(summaries: list) -> Profile:
    """One profile of every rank's summary (ranks that profiled nothing are named in ``problems``)."""
    good = [s for s in summaries if not s.get("problem")]
    problems = [f"rank {s['rank']}: {s['problem']}" for s in summaries if s.get("problem")]
    spans = {s["rank"]: [] for s in good}  # rank -> (start, end) of its waits: a union (gloo runs two at once)
    waited = {s["rank"]: Counter() for s in good}
    counts = {len(s["collectives"]) for s in good}
    if len(counts) > 1:  # matched by order of issue only when every rank issued as many
        problems.append("the ranks issued different numbers of collectives in the window "
                        f"({', '.join(str(len(s['collectives'])) for s in good)}): waiting not worked out")
    for i in range(min(counts, default=0) if len(counts) == 1 else 0):
        ins = [(s["rank"], *s["collectives"][i]) for s in good]  # (rank, name, start, seconds)
        late_rank, _, latest, _ = max(ins, key=lambda c: c[2])
        for rank, name, start, seconds in ins:
            wait = min(seconds, max(0.0, latest - start))
            if wait > 0:
                spans[rank].append((start, start + wait))
                waited[rank][(name, late_rank)] += wait
    waits = {rank: covered(found) for rank, found in spans.items()}
    rows = [{"rank": s["rank"], "steps": s["steps"], "step_s": s["step_s"], "compute_s": s["compute_s"],
             "comm_s": s["comm_s"], "wait_s": min(waits[s["rank"]], s["comm_s"]), "data_s": s["data_s"],
             "other_s": s["other_s"]} for s in sorted(good, key=lambda s: s["rank"])]
    profile = Profile(rows, [s["trace"] for s in sorted(good, key=lambda s: s["rank"])], waited, problems,
                      max((s.get("asked", 0) for s in good), default=0))
    profile.verdict = verdict(profile)
    return profile


PARTS = {"compute_s": "compute", "data_s": "data loading", "other_s": "other (Python between ops, sleeps, I/O)",
         "comm_s": "communication"}
WAIT_SHARE = 0.05  # less waiting than this share of a step is no straggler


def verdict(profile: Profile) -> str:
    """The slowest rank and why, in one line: the rank others wait for most, and what its own step is made of."""
    rows = {row["rank"]: row for row in profile.rows}
    if not rows:
        return ""

    def share(row, col):
        return row[col] / row["step_s"] if row["step_s"] > 0 else 0.0

    def made_of(row):
        col = max(("compute_s", "data_s", "other_s"), key=lambda c: row[c])
        return f"{share(row, col):.0%}".replace("%", " %") + f" {PARTS[col]}"

    waiter = max(rows.values(), key=lambda row: share(row, "wait_s"))
    if len(rows) > 1 and share(waiter, "wait_s") >= WAIT_SHARE and profile.waited.get(waiter["rank"]):
        (name, late), _ = profile.waited[waiter["rank"]].most_common(1)[0]
        pct = f"{share(waiter, 'wait_s'):.0%}".replace("%", " %")
        return (f"rank {late} is the straggler: rank {waiter['rank']} spends {pct} of its step waiting in {name} for "
                f"rank {late}, whose own step is {made_of(rows[late])}.")
    slow = max(rows.values(), key=lambda row: row["step_s"])
    if len(rows) == 1:
        return f"rank {slow['rank']}'s step is {made_of(slow)}."
    most = f"{share(waiter, 'wait_s'):.0%}".replace("%", " %")
    return (f"no straggler: no rank waits for another more than {most} of its step; the slowest is rank "
            f"{slow['rank']}, whose step is {made_of(slow)}.")


def conclude(results: list) -> Profile | None:
    """The cell's ranks answered: their profile shown in the cell and kept (None if no rank profiled)."""
    global _last
    summaries = [r.profile for r in results if r is not None and r.profile is not None]
    if not summaries:
        return None
    from ..views import profile_chart

    profile = combine(summaries)
    profile_chart.show(profile)
    if profile.rows:
        _last = profile
    return profile


def last():
    """``nbddp.profile()``: the last profile as a DataFrame."""
    from ..errors import UsageError

    if _last is None:
        raise UsageError("nbddp.profile(): no %%ddp --profile cell has profiled anything yet in this kernel.")
    return _last.frame()
