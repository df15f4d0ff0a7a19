"""Framing on a Unix socket that passes descriptors (the forkserver's exchange, forkmessages.py): each
message pickled and preceded by its length, the descriptors that go with it (SCM_RIGHTS) attached to that
length's first byte. framing.py is the pipes' framing between kernel and rank, which pass no descriptor.

Either end may be gone at any byte: a frame cut short is EOFError (the descriptors that came with it
closed), never half a message.
"""
from __future__ import annotations

import array
import contextlib
import os
import pickle
import socket
import struct

HEADER = struct.Struct("<Q")  # the body's length
MAX_FDS = 16  # descriptors one message may carry (a rank's: out, err, channel, two store pipes, command pipe)
_CHUNK = 1 << 20


class Unreadable(RuntimeError):
    """A whole frame whose message cannot be unpickled here (a class this side lacks): the stream goes on."""


def send(sock: socket.socket, message, fds=()) -> None:
    """``message`` with ``fds`` (duplicated into the other process; the caller still closes its own)."""
    if len(fds) > MAX_FDS:  # refused here: the other end would lose those past MAX_FDS without a word
        raise ValueError(f"{len(fds)} descriptors in one message (at most {MAX_FDS})")
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = sock.sendmsg([HEADER.pack(len(body))], anc)
    if sent < HEADER.size:  # the descriptors went with the first bytes; the rest of the header follows
        sock.sendall(HEADER.pack(len(body))[sent:])
    sock.sendall(body)


def receive(sock: socket.socket):
    """(message, descriptors received with it: this process's to close); EOFError when the other end is
    gone, before or inside a frame; Unreadable for a whole frame that does not unpickle here."""
    head, anc, _, _ = sock.recvmsg(HEADER.size, socket.CMSG_SPACE(MAX_FDS * 4))
    fds = _descriptors(anc)
    delivered = False
    try:
        if not head:
            raise EOFError
        head += _exactly(sock, HEADER.size - len(head))
        (n,) = HEADER.unpack(head)
        message = _load(_exactly(sock, n))
        delivered = True
        return message, fds
    finally:
        if not delivered:  # (the other end gone, Unreadable, an interrupt, a timeout): the descriptors are no one's
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _load(body: bytearray):
    try:
        return pickle.loads(body)
    except Exception as e:  # noqa: BLE001 - unpickling raises anything (a module or class this side lacks...)
        raise Unreadable(f"{type(e).__name__}: {e}") from None  # the frame was read whole: the stream goes on


def _exactly(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes, however many reads they take (not copied again: a job's pickle may be large)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _descriptors(anc) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
    return fds
