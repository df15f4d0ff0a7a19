"""The one channel from a rank to the kernel: typed records, each framed by its length, on a private pipe.

Every message a rank sends is one of the record classes below; both sides import them from here and
nowhere else builds or reads a message. A frame is an 8-byte little-endian length and a pickle of the
record (values inside a ``Result`` are already pickled, once, in the rank). Nothing else is written on
the pipe, so no byte of a frame can be mistaken for a marker.

A rank's life is a sequence of phases; an ``Error`` names the one it happened in, so a failure during
set-up reads "rank 1 failed while joining the process group: ...".
"""
from __future__ import annotations

import os
import pickle
import struct
import threading
from dataclasses import dataclass, field

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
class Healthy:
    """Pool: the rank passed the health check (a barrier) after an interrupt or a failed cell."""


# -- the other direction: what the kernel asks of a pool's ranks, on each rank's command pipe ----------
@dataclass(frozen=True)
class RunCell:
    source: str
    filename: str
    outs: tuple
    gathers: tuple
    max_value_bytes: int
    updates: dict  # notebook name -> its current value, pickled once in the kernel


@dataclass(frozen=True)
class Call:
    job: bytes  # a pickled callable: job(ctx) -> Result


@dataclass(frozen=True)
class HealthCheck:
    pass


@dataclass(frozen=True)
class Stop:
    pass


# length, then the marks: bytes the rank had written to stdout and stderr when it sent the record
HEADER = struct.Struct("<QQQ")


_MARK = pickle.dumps(Mark(), protocol=pickle.HIGHEST_PROTOCOL)


def encode(record, marks: tuple[int, int] = (0, 0)) -> bytes:
    payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload), *marks) + payload


class Writer:
    """The rank's end. ``send`` is safe from any thread (a display from a callback thread, say).
    ``marks()``: how many bytes the rank has written to stdout and stderr so far; each frame carries
    them, so the kernel can put a record exactly between the text written before and after it."""

    def __init__(self, fd: int, marks=None):
        self.fd = fd
        self.marks = marks or (lambda: (0, 0))
        self._lock = threading.Lock()

    def send(self, record) -> None:
        self._write(encode(record, self.marks()))

    def mark(self) -> None:
        """A ``Mark``: the one record sent per stream switch, so its pickle is made once."""
        self._write(HEADER.pack(len(_MARK), *self.marks()) + _MARK)

    def _write(self, frame: bytes) -> None:
        view = memoryview(frame)
        with self._lock:
            while view:
                view = view[os.write(self.fd, view):]

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class Reader:
    """The kernel's end: bytes in as they arrive, whole records out."""

    def __init__(self):
        self._buf = bytearray()
        self._need = HEADER.size  # bytes the next parse step waits for: a large frame is parsed once

    def feed(self, data: bytes) -> list:
        """Whole records so far, each as (record, (stdout mark, stderr mark))."""
        self._buf += data
        records = []
        while len(self._buf) >= self._need:
            n, out, err = HEADER.unpack_from(self._buf)
            if len(self._buf) < HEADER.size + n:
                self._need = HEADER.size + n
                break
            payload = bytes(memoryview(self._buf)[HEADER.size : HEADER.size + n])
            del self._buf[: HEADER.size + n]
            self._need = HEADER.size
            records.append((_load(payload), (out, err)))
        return records

    @property
    def pending(self) -> int:
        """Bytes of a frame that never completed (the rank died while sending it)."""
        return len(self._buf)


def _load(payload: bytes):
    try:
        return pickle.loads(payload)
    except Exception as e:  # noqa: BLE001 - a record the kernel cannot read is still reported
        import time

        return Error("results", type(e).__name__, f"a message from the rank cannot be unpickled in the kernel: {e}",
                     "", time.time())
