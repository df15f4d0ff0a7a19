"""The shared-memory buffer behind ``nbddp.shared`` (shared.py, sharedframe.py): one memfd, written once
in the kernel, mapped read-only wherever a twin is read.

A fork inherits the mapping. Anywhere else on the same machine a buffer travels by handle (memfd.py: the
kernel's pid, fd and the memfd's inode, checked against the boot id) and is mapped from
``/proc/<pid>/fd/<fd>``; to another machine, pickled under ``memfd.elsewhere()``, its bytes go with the
handle once per node, into one file of the node's run directory that the node's ranks map.
"""
from __future__ import annotations

import contextlib
import os
import weakref

from . import memfd

_ALIGN = 64
_mapped: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (boot id, inode) -> Buffer, this process


# -- the buffer ------------------------------------------------------------------------------------------------
class Buffer:
    """One memfd, mapped read-only: the contents of one ``shared()`` call. Pickled by handle."""

    def __init__(self, fd: int, size: int, owner: bool):
        self.fd, self.size = fd, size
        # the kernel maps every page at once: a page only one rank has mapped would count as that rank's
        # private memory (USS), though it is the kernel's buffer, counted once
        self.map = memfd.map_shared(fd, max(size, 1), populate=owner)
        self.view = memoryview(self.map)
        self.handle = memfd.handle(fd)
        if not owner:  # mapped: the descriptor is no longer needed (a handle pickled here opens nothing)
            os.close(fd)
            self.fd = None
            self.handle = self.handle._replace(fd=None)
        _mapped[self.handle.key] = self

    def __reduce__(self):
        carried = bytes(self.view[:self.size]) if memfd.going_elsewhere() else None
        return _attach, (self.handle, self.size, carried)

    def __del__(self):
        if self.fd is not None and os.getpid() == self.handle.pid:  # a fork's copy of the number may be reused there
            with contextlib.suppress(OSError):
                os.close(self.fd)


class BufferWriter:
    """Builds a buffer: parts appended at aligned offsets, then sealed read-only."""

    def __init__(self, name: str):
        self.fd = memfd.create(f"nbddp-shared-{name}")
        self.pos = 0

    def append(self, data) -> int:
        """Writes ``data`` (bytes-like) at the next aligned offset; returns that offset."""
        self.extend(b"\0" * (-self.pos % _ALIGN))
        start = self.pos
        self.extend(data)
        return start

    def extend(self, data) -> None:
        """Writes ``data`` right after what is there (an item's bytes follow the last's)."""
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, self.pos)
            self.pos += n
            view = view[n:]

    def seal(self) -> Buffer:
        os.ftruncate(self.fd, max(self.pos, 1))
        return Buffer(self.fd, self.pos, owner=True)


def _attach(handle: memfd.Handle, size: int, carried):
    """In a rank (or the kernel): the buffer of ``handle``, mapped once per process; its carried bytes
    where the memfd cannot be opened here (another machine)."""
    buf = _mapped.get(handle.key)
    if buf is not None:
        return buf
    with contextlib.suppress(memfd.Unreachable):
        return Buffer(memfd.open_handle(handle), size, owner=False)
    if carried is not None:
        return Buffer(_node_file(handle.key, carried), size, owner=False)
    raise RuntimeError("this nbddp.shared data lives in the kernel's memory on another machine, or its "
                       "kernel has let it go: make it again with nbddp.shared(...) in the notebook")


def _node_file(key, data: bytes) -> int:
    """Another machine: the bytes into one file of the node's run directory that every rank there maps
    (the first writes it, the others open it; removed with the run directory)."""
    err = os.environ.get("TORCHELASTIC_ERROR_FILE")
    folder = os.path.dirname(err) if err else os.environ.get("TMPDIR", "/tmp")
    path = os.path.join(folder, f"shared-{key[1]}-{key[0][:8]}.bin")
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # whole, or not there: a peer never maps half a file
    return os.open(path, os.O_RDONLY)
