"""A mending step: a ``Call`` of one of rank/heal.py's functions on some ranks (``call``), its answers awaited on the
supervisor's loop with a deadline, as a cell's are (``ask``: each rank's ``Result``, or its ``Healthy`` after a
``Regroup``), its value read (``value``). A rank lost meanwhile, an ``Error`` or an ``Exit`` instead of the answer,
no answer within the deadline (timeline.STEP_S), or an interrupt: ``HealFailed``, and the pool ends with it."""
from __future__ import annotations

import time

from ... import timeline
from ...rank import heal
from ...wire import messages, values
from ..ranks import starters

UNLIMITED = 1 << 62  # an export's pickle may be as big as it is: it goes once, from one peer


class HealFailed(RuntimeError):
    """Mending the pool failed; the message says what happened, on which rank."""


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


def ask(gang, commands: dict, what: str, within: float | None = None, also=lambda: True, expect=ANSWERS) -> dict:
    """``commands`` (rank -> command) sent, and each rank's answer (rank -> record, of the kinds ``expect``)
    once every one answered and ``also()`` holds; a rank lost meanwhile, an error, or no answer within
    ``within`` s (timeline.STEP_S, read now, unless given) is HealFailed."""
    within = timeline.STEP_S if within is None else within
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
