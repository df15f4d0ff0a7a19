"""The shared-memory buffer behind ``nbddp.shared`` (shared.py, sharedframe.py): one memfd, written once
in the kernel, mapped read-only wherever a twin is read.

A fork inherits the mapping. Anywhere else on the same machine a buffer travels by handle (the kernel's
pid, fd and the memfd's inode, checked against the boot id) and is mapped from ``/proc/<pid>/fd/<fd>``;
to another machine, pickled under ``carrying()``, its bytes go with the handle once per node, into one
file of the node's run directory that the node's ranks map.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import weakref

_ALIGN = 64
_carry = False  # pickling for another machine: the bytes go with the handle (``carrying``)
_mapped: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (host, inode) -> Buffer, this process


@contextlib.contextmanager
def carrying():
    """While pickling for ranks on other machines: twins carry their bytes (once per node)."""
    global _carry
    before, _carry = _carry, True
    try:
        yield
    finally:
        _carry = before


# -- the buffer ------------------------------------------------------------------------------------------------
class Buffer:
    """One memfd, mapped read-only: the contents of one ``shared()`` call. Pickled by handle."""

    def __init__(self, fd: int, size: int, owner: bool):
        self.fd, self.size = fd, size
        # the kernel maps every page at once: a page only one rank has mapped would count as that rank's
        # private memory (USS), though it is the kernel's buffer, counted once
        populate = getattr(mmap, "MAP_POPULATE", 0) if owner else 0
        self.map = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
        self.view = memoryview(self.map)
        st = os.fstat(fd)
        self.key = (_host(), st.st_ino)
        self.pid = os.getpid()
        if not owner:  # mapped: the descriptor is no longer needed
            os.close(fd)
            self.fd = None
        _mapped[self.key] = self

    def __reduce__(self):
        carried = bytes(self.view[:self.size]) if _carry else None
        return _attach, (self.key, self.pid, self.fd, self.size, carried)

    def __del__(self):
        if self.fd is not None and os.getpid() == self.pid:  # a fork's copy of the number may be reused there
            with contextlib.suppress(OSError):
                os.close(self.fd)


class BufferWriter:
    """Builds a buffer: parts appended at aligned offsets, then sealed read-only."""

    def __init__(self, name: str):
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create(f"nbddp-shared-{name}", os.MFD_CLOEXEC)
        else:  # no memfd (macOS): an unlinked file, shared with forks all the same
            self.fd, path = tempfile.mkstemp(prefix=f"nbddp-shared-{name}-")
            os.unlink(path)
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


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


def _attach(key, pid: int, fd, size: int, carried):
    """In a rank (or the kernel): the buffer of ``key``, mapped once per process."""
    buf = _mapped.get(tuple(key))
    if buf is not None:
        return buf
    if key[0] == _host() and fd is not None:
        try:
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
        except OSError:
            mine = None
        if mine is not None and os.fstat(mine).st_ino == key[1]:
            return Buffer(mine, size, owner=False)
        if mine is not None:
            os.close(mine)
    if carried is not None:
        return Buffer(_node_file(key, carried), size, owner=False)
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
