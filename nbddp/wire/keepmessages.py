"""A kept pool's exchange with its keeper (nbddp/keeper/), one frozen dataclass per message, framed by
wire/fdframing.py (each rank's descriptors travel with its ``KeptRank`` by SCM_RIGHTS).

The kernel that holds the pool talks on the socket pair it started the keeper with: ``Hold`` (what the pool is,
and a ``KeptRank`` per rank, its descriptors attached), answered ``Kept``; again whenever its ranks change;
``InRanks`` (the names the ranks hold, the cell running) when those change; ``End`` when the pool ends. Its end
of the pair closing without ``End`` is the kernel's end: the pool waits.

Another kernel of the same user connects to the keeper's socket: ``Describe`` (answered ``About``), ``Take``
(answered ``Taken`` and a ``KeptRank`` per rank, or ``NotTaken``, saying why); the connection that took the pool
is then the holder's, as the first kernel's pair was.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# a rank's descriptors, in the order its KeptRank carries them (the store's two only where its ranks meet on pipes)
RANK_FDS = ("pidfd", "stdout", "stderr", "channel", "command", "store_request", "store_reply")


@dataclass(frozen=True)
class About:
    """What a kept pool is, as the next kernel is told it (``%load_ext``, ``%ddp pools``)."""

    pool_id: str
    devices: str  # "2 × cpu (gloo)", as the dashboard names them
    world_size: int
    options: str  # the options it was started with, as ``%ddp start`` took them
    notebook: str  # JPY_SESSION_NAME of the kernel that started it, where Jupyter set it
    started_at: float  # time.time()
    keep_s: float  # how long it waits for a kernel once its own has ended (--keep DURATION)
    holder_pid: int | None = None  # the kernel that holds it now; None while it waits
    orphaned_at: float | None = None  # time.time() its kernel ended, while it waits
    ranks_alive: int = 0
    run_dir: str = ""
    keeper_pid: int = 0  # the keeper's (said by itself)
    names: tuple = ()  # the names the ranks bound themselves (the pool's cells'), as its holder last said (``InRanks``)
    running: str = ""  # the cell running in the ranks when its holder last said (its first line), or ""
    background: bool = False  # that cell is a --bg one (it goes on when the kernel ends; a cell the notebook waited
    # for is interrupted: nobody waits for it any more)
    cell: str = ""  # that cell as nbddp.metrics() files its rows ("In [7]"): its curves go on in the next kernel
    brings: tuple = ()  # the names that cell's --out/--gather bring back (a --bg one's: the next kernel's)
    mending: bool = False  # its holder is mending it (a replacement joining, its group made anew): if the holder ends
    # meanwhile, the pool ends with it (only a kernel mends a pool; ranks half regrouped would wait for ever)


@dataclass(frozen=True)
class KeptRank:
    """One rank: its number and pid; its descriptors (``RANK_FDS``, the first ``len(fds)``) come with the frame."""

    rank: int
    pid: int
    fds: tuple = RANK_FDS


@dataclass(frozen=True)
class Hold:
    """The holder's whole word on its pool: ``about``, ``state`` (the kernel's own description, pickled by it:
    the keeper never reads it), then ``ranks`` KeptRank frames."""

    about: About
    state: bytes
    ranks: int


@dataclass(frozen=True)
class Kept:
    """The keeper has every descriptor of the last Hold."""


@dataclass(frozen=True)
class InRanks:
    """The holder's word between Holds, unanswered: the names the ranks hold now and the cell running in them (its
    first line; "" once none is), sent when either changes: what the next kernel is told if this one ends."""
    names: tuple
    running: str
    background: bool = False
    cell: str = ""  # (About.cell)
    brings: tuple = ()  # (About.brings)
    mending: bool = False  # (About.mending)


@dataclass(frozen=True)
class End:
    """The holder ends the pool (``%ddp stop``, ``%ddp restart``, a failure that ended it): its ranks are being
    stopped. A kernel that ends without it, however it ends (killed, or shut down by Jupyter), leaves it kept."""


@dataclass(frozen=True)
class Describe:
    pass


@dataclass(frozen=True)
class Take:
    """A kernel asks for the pool (its pid is read from the socket's peer credentials, not said)."""


@dataclass(frozen=True)
class Taken:
    """The pool is the asking kernel's: ``state`` (as the last Hold gave it), what the ranks wrote while no
    kernel held it (``buffered``: rank -> {"stdout"|"stderr"|"channel": bytes}, ``dropped``: rank -> stream ->
    bytes left out past the keeper's bound; ``order``: (rank, stream, bytes), the text in the order it was read,
    across ranks), then ``ranks`` KeptRank frames."""

    about: About
    state: bytes
    ranks: int
    buffered: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)
    order: list = field(default_factory=list)


@dataclass(frozen=True)
class NotTaken:
    why: str
