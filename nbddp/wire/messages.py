"""Every message between kernel and rank, as a typed record: what a rank sends on its channel
(``RANK_SENDS``) and the commands a pool's kernel sends on each rank's command pipe (``KERNEL_SENDS``).
Both sides import them from here and nowhere else builds or reads a message; framing.py frames them
(values inside a ``Result`` are already pickled, once, in the rank).

A rank's life is a sequence of phases; an ``Error`` names the one it happened in, so a failure during
set-up reads "rank 1 failed while joining the process group: ...".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

# phase -> what the rank was doing, as a message says it ("rank 1 failed while ...")
PHASES = {
    "start": "starting up",
    "job": "loading the job sent to it",
    "threads": "setting torch's thread count",
    "device": "selecting its GPU",
    "group": "joining the process group",
    "cell": "running the cell",
    "results": "sending its results",
    "leave": "leaving the process group",
}


@dataclass(frozen=True)
class Mark:
    """The rank's Python code switched from writing one stream to the other: the frame's marks (no
    payload) let the kernel show the two streams in the order the rank wrote them. Sent only on a
    switch, so a rank that writes one stream never sends one; it reaches no subscriber."""


@dataclass(frozen=True)
class Ready:
    """The process group is up: the rank is running the job."""


@dataclass(frozen=True)
class Display:
    """A rich output (IPython's publish_display_data), MIME bundle and all."""

    data: dict
    metadata: dict = field(default_factory=dict)
    display_id: str | None = None  # the rank's own id (display(..., display_id=...)), for updates
    update: bool = False


@dataclass(frozen=True)
class ClearOutput:
    """``clear_output()`` in the rank: clears what this rank displayed, nothing else."""

    wait: bool = False


@dataclass(frozen=True)
class Progress:
    """A tqdm bar of the rank, each time tqdm would redraw it (its own ``mininterval`` and ``miniters``
    still decide when): ``bar`` numbers the rank's bars in the order they first drew; ``state`` is tqdm's own
    ``format_dict`` (n, total, prefix: its desc, unit, rate, elapsed, postfix, bar_format, ...: plain
    values); ``line`` is the text tqdm would have drawn for it (``str(bar)``, its subclass's formatting
    included), kept as text by the rank's log. ``closed``: its last state; ``leave``: kept (else cleared,
    ``tqdm(leave=False)``); ``stream``: the one tqdm would have drawn it on."""

    bar: int
    state: dict
    line: str
    closed: bool = False
    leave: bool = True
    stream: str = "stderr"

    @property
    def fraction(self) -> float | None:
        """How far it is (0 to 1), None without a total."""
        total = self.state.get("total")
        return min(1.0, max(0.0, (self.state.get("n") or 0) / total)) if total else None

    @cached_property
    def scalars(self) -> dict:
        """The numbers of its postfix (``set_postfix(loss=0.31)``: ``{"loss": 0.31}``), charted as
        ``nbddp.log``'s are, at step ``n``: read once per record, however many listeners chart it (the
        cell's view, the pool's, ``nbddp.metrics``' recorder)."""
        found = {}
        for part in str(self.state.get("postfix") or "").split(","):
            name, eq, value = part.partition("=")
            if eq:
                try:
                    found[name.strip()] = float(value.strip())
                except ValueError:
                    pass
        return found


@dataclass(frozen=True)
class Scalars:
    """What the rank logged (``nbddp.log``) since its last ``Scalars``, one column per name: row ``i`` is
    logged at ``steps[i]`` (``time.time()``: ``times[i]``) with ``values[name][i]`` (NaN: not logged
    in that call). Sent at most four times a second, and before the rank's ``Result`` (rank/metrics_log.py)."""

    steps: tuple
    times: tuple
    values: dict  # name -> tuple of floats, as long as steps


@dataclass(frozen=True)
class Item:
    """One value to bring back: its pickle, or why it cannot come."""

    blob: bytes | None = None
    problem: str | None = None


@dataclass(frozen=True)
class Result:
    """What the job produced: its return value, --out names (rank 0), --gather names (every rank)."""

    value: Item | None = None
    outs: dict = field(default_factory=dict)  # name -> Item
    gathers: dict = field(default_factory=dict)  # name -> Item
    assigned: tuple = ()  # names the cell (re)bound on this rank (a pool keeps them the rank's own)
    # modules the rank imported since its last answer (the kernel warms them: kernel/ranks/warm.py)
    imported: tuple = ()
    # (bytes, ((name, what), ...)): private memory grew reading notebook Python objects (copywatch.py)
    copied: tuple = ()
    profile: dict | None = None  # --profile: this rank's summary of its profiled steps (rank/profile_session.py)


@dataclass(frozen=True)
class Error:
    """An exception in the rank, in any phase of its life."""

    phase: str
    type: str
    message: str
    traceback: str
    time: float


@dataclass(frozen=True)
class Exit:
    """The rank's own code ended it (sys.exit, exit(), quit()) before the job finished."""

    code: int
    where: str  # the line that called it, as the traceback shows it
    phase: str
    time: float


@dataclass(frozen=True)
class Done:
    """The rank finished its job and left the process group: it exits with code 0 next."""


@dataclass(frozen=True)
class InputRequest:
    """The rank reads a line (``input()``, ``sys.stdin``, ``getpass``, pdb's prompt): the kernel asks the
    notebook's input box and answers with an ``InputReply`` of the same ``id`` on the command pipe."""

    id: int
    prompt: str
    password: bool = False


@dataclass(frozen=True)
class Heard:
    """Pool: the rank's Python handler of the kernel's interrupt ran (its main thread is back in Python: its answer
    comes, however long its cleanup takes), sent from the handler when the channel is free. A rank interrupted
    that never says so, and waits on a futex using no CPU, is held in native code: a collective
    (kernel/cells/grace.py)."""


@dataclass(frozen=True)
class Healthy:
    """Pool: the rank passed the health check (a barrier) after an interrupt or a failed cell, or made
    its fresh process group (``Regroup``): then ``bound`` names what in its namespace was bound to the
    old group (``model (DistributedDataParallel)``)."""

    bound: tuple = ()


# -- the other direction: what the kernel asks of a pool's ranks, on each rank's command pipe ----------
@dataclass(frozen=True)
class RunCell:
    source: str
    filename: str
    outs: tuple
    gathers: tuple
    max_value_bytes: int
    updates: dict  # notebook name -> its current value, pickled once in the kernel
    post_mortem: bool = False  # IPython's %pdb is on: an exception opens pdb in the rank first
    lead: int = 0  # the rank whose last expression and --out names come back (a pool's --ranks: the first)
    # notebook names the ranks forget: rebound to a value that cannot be sent (kernel/names/sending.py)
    dropped: tuple = ()
    # JupyterLab's debugger panel is on: where the rank's debugger connects (rank/debugpanel.py)
    debug: dict | None = None
    profile: tuple | None = None  # --profile: (steps, the run's folder, where each rank writes its trace)


@dataclass(frozen=True)
class Call:
    job: object  # job(ctx) -> Result: cloudpickled on a pool's pipe; a one-shot rank's came with the fork


@dataclass(frozen=True)
class InputReply:
    """The notebook's answer to the rank's ``InputRequest`` ``id``: the line typed, or the exception the
    rank raises instead (``error``: its type name, ``message``), as a plain cell would."""

    id: int
    value: str | None = None
    error: str | None = None
    message: str = ""


@dataclass(frozen=True)
class Update:
    """Pool: notebook names for a rank that does not run this cell (``--ranks``), so that every rank has
    the notebook's latest values; no answer."""

    updates: dict  # as RunCell's
    dropped: tuple = ()  # as RunCell's


@dataclass(frozen=True)
class PostMortem:
    """Pool, ``%ddp debug``: pdb in the traceback of the rank's last failed cell."""


@dataclass(frozen=True)
class HealthCheck:
    pass


@dataclass(frozen=True)
class Regroup:
    """Pool: leave the process group and make a fresh one (generation ``generation`` on nbddp's store).
    Leaving closes this rank's connections, which frees a peer stuck in a collective no rank will join
    (its collective fails: "Connection closed by peer"); every rank answers ``Healthy`` once regrouped.
    ``rank`` and ``world_size``, when given: the rank's new place (a pool shrunk or resized); ``place``, the
    environment variables that say it where they are more than those two say (a pool across nodes: its rank's
    place on its node, and its node's among the nodes)."""

    generation: int
    rank: int | None = None
    world_size: int | None = None
    place: dict | None = None


@dataclass(frozen=True)
class Stop:
    pass


RANK_SENDS = (Mark, Ready, Display, ClearOutput, Progress, Scalars, InputRequest, Result, Error, Exit, Done, Heard,
              Healthy)
KERNEL_SENDS = (RunCell, Call, Update, InputReply, PostMortem, HealthCheck, Regroup, Stop)
