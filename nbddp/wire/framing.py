"""Framing on the pipes between kernel and rank: each record (wire/messages.py) pickled and preceded by
a magic, its length and the rank's stream marks. Nothing else is written on a channel pipe, so no byte of a
frame can be mistaken for a marker. ``Writer`` is the rank's end (any thread), ``Reader`` the kernel's; a
pool's commands travel the other way in the same frames.

The magic lets a reader that starts in the middle of a frame find the next one: a kept pool's channel, read
by its keeper from wherever the kernel that died had read it to (``Reader.skipped`` says how much was not a
whole frame).
"""
from __future__ import annotations

import os
import pickle
import struct
import threading

from .messages import Error, Mark

# the magic, the length, then the marks: bytes the rank had written to stdout and stderr when it sent the record
HEADER = struct.Struct("<4sQQQ")
MAGIC = b"\x93NBf"


_MARK = pickle.dumps(Mark(), protocol=pickle.HIGHEST_PROTOCOL)


def encode(record, marks: tuple[int, int] = (0, 0)) -> bytes:
    payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(MAGIC, len(payload), *marks) + payload


def write_all(fd: int, data: bytes) -> None:
    """``data`` whole on a pipe (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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

    def try_send(self, record) -> bool:
        """``send``, unless a frame is being written (then False: a signal handler may have interrupted that very
        write, on its own thread, and would wait for itself)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            write_all(self.fd, encode(record, self.marks()))
        finally:
            self._lock.release()
        return True

    def mark(self) -> None:
        """A ``Mark``: the one record sent per stream switch, so its pickle is made once."""
        self._write(HEADER.pack(MAGIC, len(_MARK), *self.marks()) + _MARK)

    def _write(self, frame: bytes) -> None:
        with self._lock:
            write_all(self.fd, frame)

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
        self.skipped = 0  # bytes that began no frame (the rest of one whose start another reader had)

    def feed(self, data: bytes) -> list:
        """Whole records so far, each as (record, (stdout mark, stderr mark))."""
        self._buf += data
        records = []
        while len(self._buf) >= self._need:
            magic, n, out, err = HEADER.unpack_from(self._buf)
            if magic != MAGIC:  # not a frame's start: to the next one (the last bytes may begin its magic)
                at = self._buf.find(MAGIC, 1)
                cut = at if at > 0 else len(self._buf) - len(MAGIC) + 1
                del self._buf[:cut]
                self.skipped += cut
                continue
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
