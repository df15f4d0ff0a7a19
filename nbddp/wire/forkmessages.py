"""The forkserver's exchange (kernel/ranks/forkserver.py asks, rank/forkloop.py answers), one dataclass per
message, framed by fdframing.py. The kernel sends one request at a time and reads until its reply; the
server answers every request, one it does not know with ``Refused``, and sends ``Reaped`` whenever a rank
of its ends, between replies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# -- the kernel asks ---------------------------------------------------------------------------------------------
@dataclass
class Prepare:
    """The kernel's settings at the cell, and the modules it has imported that the server may lack."""

    path: list[str]
    cwd: str
    environ: dict[str, str]
    modules: list[str]


@dataclass
class SetJob:
    """The gang's job, pickled once (each rank the server forks next unpickles it)."""

    blob: bytes


@dataclass
class Fork:
    """One rank: its spec (rank/worker.py's RankSpec) and the role of each descriptor sent with this message,
    in order (out, err, chan; store_req, store_rep, cmd where the rank has them)."""

    spec: Any
    roles: tuple[str, ...]


# -- the server answers ------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """``failed``: modules that could not be imported (the rank imports them itself); ``poisoned``: the
    package whose import initialised CUDA in the server, which then ends."""

    failed: list[str] = field(default_factory=list)
    poisoned: str | None = None


@dataclass
class JobSet:
    pass


@dataclass
class Forked:
    """A rank forked; its pidfd comes with this answer (the server opened it before it could reap the rank): the
    kernel's then refers to that process, even if it ended and its number was taken by another meanwhile."""

    pid: int
    pidfd: int = -1  # set where it is received: the descriptor that came with it


@dataclass
class Refused:
    """The request could not be done (a fork that failed), or the server does not know it."""

    error: str


# -- the server tells, unasked -----------------------------------------------------------------------------------
@dataclass
class Reaped:
    """A rank the server forked has ended and was reaped: its wait status and peak RSS."""

    pid: int
    status: int
    peak_rss: int
