"""One memfd's life, for the values that reach ranks through shared memory (sharedtensor.py's arenas,
sharedbuffer.py's twins): made, its space reserved, named by a handle, opened by another process of this
machine, mapped; and where the values being pickled are going (``elsewhere``).

A memfd lives in whichever process made it (the kernel today; any process may: a rank's arena opened by
another rank is the same handle). Its ``Handle`` names it by that process and its descriptor number, which
another process opens as ``/proc/<pid>/fd/<fd>``; the memfd's inode is checked once it is open (the number
may hold another file by then) and the machine's boot id before (a handle that travelled to another
machine opens nothing). ``memfd_create`` rather than ``/dev/shm``: Docker's 64 MB ``/dev/shm`` does not
bound it.
"""
from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import mmap
import os
import tempfile
from typing import NamedTuple

from ..units import size

# pickling for ranks of which some are on another machine: they cannot open this machine's memfds. A
# ContextVar, not a module flag: the notebook's thread and a background cell's may pickle at once, for
# different pools
_elsewhere: contextvars.ContextVar[bool] = contextvars.ContextVar("nbddp_values_elsewhere", default=False)


class SharedMemoryFull(MemoryError):
    """There is not room in memory for a notebook value the ranks need; the message says how much."""


class Unreachable(RuntimeError):
    """A handle's memfd cannot be opened here: another machine, or the process holding it is gone."""


class Replaced(Unreachable):
    """The descriptor a handle names holds another file now: its memfd was let go before it was opened."""


class Handle(NamedTuple):
    """A memfd as another process of this machine opens it. ``pid``: the process that holds it (any);
    ``fd``: its number there (None: that process holds no descriptor, only a mapping)."""

    boot: str
    inode: int
    pid: int
    fd: int | None

    @property
    def key(self) -> tuple[str, int]:
        """The memfd itself, whoever holds it: a process maps each one once."""
        return self.boot, self.inode


# -- where the values go ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def elsewhere(on: bool = True):
    """While pickling for ranks of which some are on other machines (``on``): tensors go by value, shared
    buffers carry their bytes. Set by the sender; never turned off inside a sender that turned it on."""
    token = _elsewhere.set(_elsewhere.get() or on)
    try:
        yield
    finally:
        _elsewhere.reset(token)


def going_elsewhere() -> bool:
    return _elsewhere.get()


# -- the process that makes one --------------------------------------------------------------------------------
def available() -> bool:
    """Memfds, and /proc to open another process's (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def create(name: str) -> int:
    """A new memfd (closed on exec), named ``name`` in /proc/<pid>/fd; without memfds (macOS) an unlinked
    file, which forks share all the same."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix=f"{name}-")
    os.unlink(path)
    return fd


def reserve(fd: int, offset: int, length: int, *, wanted: int | None = None) -> None:
    """The space of ``length`` bytes at ``offset``, taken now, before a byte is written: a shortage is
    SharedMemoryFull here (saying ``wanted`` bytes, else ``length``), never a SIGBUS in a process that maps
    a page that was never there."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SharedMemoryFull(size(length if wanted is None else wanted)) from None
        raise


def handle(fd: int) -> Handle:
    """This process's memfd ``fd``, as another process opens it."""
    return Handle(boot_id(), os.fstat(fd).st_ino, os.getpid(), fd)


def map_shared(fd: int, length: int, *, offset: int = 0, writable: bool = False, populate: bool = False):
    """``length`` bytes at ``offset``, mapped shared (what is written there, every mapper sees).
    ``populate``: every page mapped now (a page only one rank has mapped would count as that rank's own)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, length, flags=flags, prot=prot, offset=offset)


# -- another process of this machine ---------------------------------------------------------------------------
def open_handle(h: Handle) -> int:
    """A descriptor of this process's own, read-only, for ``h``'s memfd (the caller closes it). Raises
    Unreachable (another machine, the holder or its descriptor gone) or Replaced (another file there now)."""
    if h.boot != boot_id():
        raise Unreachable("another machine")
    if h.fd is None:
        raise Unreachable(f"process {h.pid} holds no descriptor of it")
    try:
        fd = os.open(f"/proc/{h.pid}/fd/{h.fd}", os.O_RDONLY)
    except OSError as e:
        raise Unreachable(str(e)) from None
    if os.fstat(fd).st_ino != h.inode:
        os.close(fd)
        raise Replaced(f"/proc/{h.pid}/fd/{h.fd} is another file now")
    return fd


def map_private(fd: int):
    """The whole memfd, mapped privately (``MAP_PRIVATE``): every mapper reads the same pages, and a write
    copies the page it touches, as fork's copy-on-write does: no other process sees it."""
    return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


@functools.cache
def boot_id() -> str:
    """This machine's boot, as Linux names it (else its host name): a handle from another machine, or from
    before a reboot, is told apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename
