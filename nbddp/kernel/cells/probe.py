"""Ranks still in the cell after every other rank answered: where are they? (the collective probe)

``ALONE_S`` after the last answer, the ranks still running the cell are asked for their Python stacks
(faulthandler; the stack capture keeps them from the cell's output). One waiting in a torch.distributed
collective that no peer will join (they finished without it) is *stranded*: under torchrun its peers would
exit and the collective fail, so the cell fails now instead of hanging. A rank merely slower goes on,
asked again every ``STILL_S``; one whose stack has not moved between two asks is shown in the cell,
once: it may be stuck in native code, or in one long call, and the user learns where without --timeout.
"""
from __future__ import annotations

import time

from ... import timeline
from ...ipy import tracebacks
from ...units import ranks_text
from ..ranks import failure
from ..ranks.stacks import StackCapture


class CollectiveProbe:
    """For one cell on ``ranks``; ``replies`` (rank -> its answer) is the cell's, filled as answers come.
    ``say(text)``: a line in the cell's output; ``on_stranded()``: what that verdict does at once
    (one-shot: stop every rank; a pool ends the cell and frees the rank by a fresh process group)."""

    def __init__(self, sup, ranks, replies: dict, stacks: StackCapture, relabel, say, on_stranded=None):
        self.sup, self.ranks, self.replies, self.stacks = sup, ranks, replies, stacks
        self.relabel, self.say, self.on_stranded = relabel, say, on_stranded
        self.asks = 0  # times the ranks still in the cell were asked where they are
        self.frames: dict[int, tuple] = {}  # rank -> its main thread's frames at the last ask
        self.shown_still: set[int] = set()  # ranks shown as not moving (said once each)
        self.stranded: dict[int, tuple[str, str]] = {}  # rank -> (collective, where): waiting for peers that finished
        self.asked_after = 0.0  # the last answer's time when the ranks were last asked

    def due(self, last_reply: float | None) -> float | None:
        """When the ranks still in the cell are next asked: ALONE_S after the last answer, then every
        STILL_S; never once a verdict is in (a rank stranded, or every rank still there shown as not moving)."""
        if last_reply is None or self.stranded or (self.shown_still and self.shown_still >= set(self.frames)):
            return None
        return last_reply + (timeline.ALONE_S if not self.asks else timeline.STILL_S * self.asks)

    def check(self, last_reply: float | None, stopping: bool) -> None:
        """Ask, if it is time (``stopping``: the ranks were interrupted or timed out: nothing to ask)."""
        due = self.due(last_reply)
        if due is None or time.monotonic() < due or stopping or self.sup.timed_out:
            return
        waiting = [p.rank for p in self.sup.live() if p.rank in self.ranks and p.rank not in self.replies]
        if waiting and len(self.replies) == len(self.ranks) - len(waiting):
            self.asks += 1
            self.asked_after = last_reply
            self.sup.request_stacks(waiting, then=self._judge)

    def _judge(self) -> None:
        dumps = self.stacks.stacks()
        self.stacks.release()
        waiting = {r: tracebacks.main_thread(d) for r, d in dumps.items() if r not in self.replies}
        calls = {r: tracebacks.collective(frames) for r, frames in waiting.items()}
        if None not in calls.values():  # (a rank still computing may yet join the others' collective)
            for rank, name in calls.items():  # ranks in the same collective may be waiting for each other
                if list(calls.values()).count(name) == 1:
                    self.stranded[rank] = (name,
                                           failure.was_at(waiting[rank], self.relabel, "was in nbddp's own frames"))
        if self.stranded:
            if self.on_stranded is not None:
                self.on_stranded()
            return
        self._show_still(waiting)

    def _show_still(self, waiting: dict[int, list]) -> None:
        finished = sorted(self.replies)
        for rank, frames in waiting.items():
            if frames and self.frames.get(rank) == tuple(frames) and rank not in self.shown_still:
                self.shown_still.add(rank)
                where = tracebacks.where(frames, self.relabel) or "nbddp's own frames (not in the cell's code)"
                after = time.monotonic() - self.asked_after
                others = f"{ranks_text(finished)} finished" if finished else "the cell began"
                self.say(f"nbddp: rank {rank} is still at {where}, {after:.0f} s after {others}, and its Python "
                         "stack has not moved; Interrupt to stop it.\n")
            self.frames[rank] = tuple(frames)

