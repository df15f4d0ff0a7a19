"""A cluster pool's exchange with the agent on each other node (cluster/remote.py's ``Link`` and ``Streams`` are
the kernel's end, cluster/agent.py's ``Agent`` the node's), one frozen dataclass per message.

The kernel's calls (``KERNEL_CALLS``) go one at a time through the agent's ``control``, each pickled in an
``AgentCall``: the pool's id (an agent kept from the kernel's last pool ignores that pool's late calls) and its
sequence number (the agent applies them in that order, whatever order Ray's threads deliver them in). The agent
refuses one it does not know by its type's name, on its stream (``CallFailed``).

The agent's stream carries, in pickled batches, its supervisor's events (kernel/ranks/supervisor.py's
``Output``, ``OutputClosed``, ``Message``, ``Exited``) and what it has to say of its own (``AGENT_SENDS``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


# -- the kernel calls ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentCall:
    """The envelope of each of the kernel's calls: ``call`` (one of ``KERNEL_CALLS``) of the pool ``pool``, the
    ``seq``-th the kernel sent that node."""

    pool: Any  # the kernel's id for the pool (its run id)
    seq: int
    call: Any


@dataclass(frozen=True)
class Command:
    """A framed command (wire/framing.py) for the command pipes of the node's ranks ``ranks``."""

    op: ClassVar[str] = "command"  # its name in what a user reads ("could not apply the kernel's 'command'")

    frame: bytes
    ranks: list[int]


@dataclass(frozen=True)
class StoreReply:
    """The kernel's store answering a ``StoreRequest``: a frame for the store reply pipe of the process that asked
    (``pid``: a renumbering meanwhile cannot send it to another)."""

    op: ClassVar[str] = "store_reply"  # its name in what a user reads ("could not apply the kernel's 'store_reply'")

    pid: int
    frame: bytes


@dataclass(frozen=True)
class Signal:
    """A signal for rank ``rank`` (``group``: its process group)."""

    op: ClassVar[str] = "signal"  # its name in what a user reads ("could not apply the kernel's 'signal'")

    rank: int
    sig: int
    group: bool


@dataclass(frozen=True)
class LookAtRanks:
    """How each live rank of the node is (as /proc tells): answered with ``Looked``; ``ask``: the kernel's count of
    such asks for this node."""

    op: ClassVar[str] = "look"  # its name in what a user reads ("could not apply the kernel's 'look'")

    ask: int


@dataclass(frozen=True)
class Renumber:
    """The pool shrank: the node's survivors, old rank -> new; marked on the stream with ``Renumbered``."""

    op: ClassVar[str] = "renumber"  # its name in what a user reads ("could not apply the kernel's 'renumber'")

    moves: dict[int, int]


@dataclass(frozen=True)
class ForkAgain:
    """A new rank (a lost one's replacement), from ``spec`` (rank/worker.py's RankSpec); said with ``RankForked``."""

    op: ClassVar[str] = "fork_again"  # its name in what a user reads ("could not apply the kernel's 'fork_again'")

    spec: Any


@dataclass(frozen=True)
class Finish:
    """The kernel's pool is done with the node: once its ranks have exited, the stream ends."""

    op: ClassVar[str] = "finish"  # its name in what a user reads ("could not apply the kernel's 'finish'")


KERNEL_CALLS = (Command, StoreReply, Signal, LookAtRanks, Renumber, ForkAgain, Finish)


# -- the agent says, on its stream ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreRequest:
    """A request a rank made of the kernel's store (a decoded frame: request id, op, args); ``pid``: the rank's
    process, where the reply goes (``StoreReply``)."""

    pid: int
    request: Any


@dataclass(frozen=True)
class CallFailed:
    """A call of the kernel's the agent could not apply, or does not know: the kernel ends the node with it."""

    error: str


@dataclass(frozen=True)
class RankForked:
    """The rank ``ForkAgain`` asked for, forked: its pid on the node."""

    rank: int
    pid: int


@dataclass(frozen=True)
class Renumbered:
    """The agent applied a ``Renumber``: what its stream says after this carries the new numbers."""


@dataclass(frozen=True)
class Looked:
    """The answer to ``LookAtRanks`` ``ask``: rank -> its look (hw/procwait.py's Look), for each live rank."""

    ask: int
    looks: dict[int, Any]


AGENT_SENDS = (StoreRequest, CallFailed, RankForked, Renumbered, Looked)
