"""Notebook tensors and arrays to ranks through shared memory, never a pickle per rank.

In the kernel, ``Sharer.place`` copies a CPU tensor's storage (or a numpy array's bytes) once into a memfd
(``Arena``: ``memfd_create``, so Docker's 64 MB ``/dev/shm`` does not bound it; its space reserved with
``posix_fallocate`` before a byte is written, so a shortage is an error here, never a SIGBUS in a rank) and
pickles a handle: the kernel's pid, the memfd's number and inode, the place and the layout. A rank maps the
whole arena once, privately (``MAP_PRIVATE``): every rank reads the same pages, and a rank's in-place write
copies the page it touches, as fork's copy-on-write does, so neither the notebook nor the other ranks see it.

What a rank gets is the notebook's data when the cell was sent: an arena is never written again. A tensor
the notebook changes in place (its version counter moves) or rebinds is copied anew at the next send; an
unchanged one is found again (``Sharer``'s cache: the same Python object, data pointer and version) and only
its handle travels. Arenas hold many tensors each (one per send: 10,000 tensors are one descriptor in the
kernel, none in a rank), and are let go once no notebook value they hold is alive and unchanged.

Small values (under ``MIN_BYTES``) are pickled as they are; so are tensors that are not plain dense CPU
tensors (sparse, quantized, a subclass, one that needs a graph). Under ``memfd.elsewhere()`` (ranks on another
machine) everything is pickled by value. A memfd's making, handle, opening and mapping are memfd.py's.
"""
from __future__ import annotations

import contextlib
import contextvars
import mmap
import os
import sys
import threading
import weakref

from . import memfd

# the kernel's GPU tensors: the CUDA seam's ``share(tensor) -> (rebuild, args) | None`` (hw/cuda.py, CUDA IPC),
# set by the kernel at %load_ext (the wire imports no seam); None: they travel as their CPU copies, pickled
gpu_share = None
MIN_BYTES = 64 << 10  # smaller tensors and arrays are pickled as they are (a page rounds each up: <= 6 % here)
_PAGE = mmap.PAGESIZE
SharedMemoryFull = memfd.SharedMemoryFull  # what a send raises where an arena finds no room (sending.py catches it)
# pickling for GPU ranks that are no fork of the kernel (``handing_gpu``): its GPU tensors by CUDA IPC. A
# ContextVar, as memfd.elsewhere's: two threads may pickle at once, for different ranks
_gpu: contextvars.ContextVar[bool] = contextvars.ContextVar("nbddp_handing_gpu", default=False)


@contextlib.contextmanager
def handing_gpu(on: bool):
    """While pickling for GPU ranks the forkserver starts: the kernel's GPU tensors go by CUDA IPC
    (``gpu_share``); for any other ranks they travel as their CPU copies."""
    token = _gpu.set(on)
    try:
        yield
    finally:
        _gpu.reset(token)


def enabled() -> bool:
    """Values pickled now go through shared memory: ranks of this machine only, which has memfds."""
    return not memfd.going_elsewhere() and memfd.available()


# -- the kernel's side ------------------------------------------------------------------------------------------
class Arena:
    """One memfd holding the bytes of one send's values, each at a page-aligned offset. Once the send is
    pickled the kernel maps it whole and keeps that mapping (``seal``): a page one rank maps then counts as
    shared, not as that rank's own, and an array's bytes can be compared with what the ranks were sent.
    One descriptor per arena (Python's mmap holds a duplicate of the one it maps: one mapping, not one per
    value, or 10,000 tensors would be 10,000 descriptors)."""

    def __init__(self):
        self.fd = memfd.create("nbddp-tensors")
        self.handle = memfd.handle(self.fd)  # (this process is its owner: a fork's copy never closes it)
        self.end = 0
        self.map: mmap.mmap | None = None
        self.users = 0  # cache entries that point here

    def write(self, src) -> int:
        """``src``'s bytes (a flat uint8 tensor or array) at the next page, their space reserved first (a
        shortage is SharedMemoryFull here, never a SIGBUS in a rank). Returns the offset."""
        start, n = self.end, max(int(src.nbytes), 1)
        rounded = -(-n // _PAGE) * _PAGE
        memfd.reserve(self.fd, start, rounded, wanted=n)
        m = memfd.map_shared(self.fd, n, offset=start, writable=True)
        try:
            _bytes_of(m, src.nbytes).copy_(_as_tensor(src))  # torch copies with every core
        finally:
            m.close()
        self.end = start + rounded
        return start

    def seal(self) -> None:
        """The kernel maps the whole arena (its pages are all there: no new memory); again if it grew since
        (an array compared while its send was still being written)."""
        if self.end and (self.map is None or len(self.map) < self.end):
            self.map = memfd.map_shared(self.fd, self.end, populate=True)

    def bytes_at(self, offset: int, nbytes: int):
        self.seal()
        return _bytes_of(self.map, nbytes, offset)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None
        if self.fd is not None and os.getpid() == self.handle.pid:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.fd = None


def _bytes_of(buffer, nbytes: int, offset: int = 0):
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)


def _as_tensor(src):
    import torch

    return src if isinstance(src, torch.Tensor) else torch.from_numpy(src)


class _Entry:
    __slots__ = ("ref", "ptr", "version", "arena", "offset", "nbytes")


class Sharer:
    """The kernel's arenas and what they hold: one per process (``sharer()``)."""

    def __init__(self):
        self._lock = threading.RLock()  # a background cell's thread and the notebook's may send at once
        self._cache: dict[int, _Entry] = {}  # id(the notebook's tensor or array) -> where its bytes are
        self._arena: Arena | None = None  # the send being pickled's, until it ends
        self._by_place: dict = {}  # (address, bytes) -> the latest entry there: views of a storage share its copy
        self._depth = 0
        self._idle: list[Arena] = []  # no entry points there any more: closed at the next send's start
        self.copied = 0  # bytes copied into arenas in the current send
        self.shared = 0  # bytes of values the current send shares (copied or found again)
        self.on_gpu = 0  # bytes of the kernel's GPU tensors the current send hands over by CUDA IPC

    @contextlib.contextmanager
    def send(self):
        """One send: the values pickled meanwhile that are not in an arena yet go into one new arena."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self.copied = self.shared = self.on_gpu = 0
                for arena in self._idle:
                    if arena.users == 0:
                        arena.close()
                self._idle = [a for a in self._idle if a.fd is not None]
            try:
                yield self
            finally:
                self._depth -= 1
                if self._depth == 0:
                    if self._arena is not None:
                        self._arena.seal()
                    self._arena = None

    def place(self, obj, ptr: int, nbytes: int, version, src_for, *,
              compare: bool = False) -> tuple[memfd.Handle, int]:
        """(arena handle, offset) of the ``nbytes`` at ``ptr`` that ``obj`` holds (``src_for()``: them as a
        flat uint8 tensor or array, read only when needed), copied once and found again while a value
        holding them is alive at the same address and ``version`` (a tensor's views share its version
        counter); ``compare``: no version (numpy), the bytes are compared instead."""
        with self._lock:
            self.shared += nbytes
            found = self._cache.get(id(obj))
            if found is None or found.ref() is not obj:
                found = self._by_place.get((ptr, nbytes))  # another view of a storage copied before
            if found is not None and (found.ref() is None or found.ptr != ptr or found.nbytes != nbytes
                                      or found.version != version or compare and not _equal(found, src_for())):
                found = None
            if found is not None and found is self._cache.get(id(obj)):
                return found.arena.handle, found.offset  # this very value, unchanged
            if found is not None:
                arena, offset = found.arena, found.offset
            else:
                if self._arena is None:
                    self._arena = Arena()
                arena = self._arena
                offset = arena.write(src_for())
                self.copied += nbytes
            self._forget(id(obj))
            entry = _Entry()
            entry.ref = weakref.ref(obj, lambda _, key=id(obj): self._forget(key))  # noqa: B008 - the id now
            entry.ptr, entry.nbytes, entry.version, entry.arena, entry.offset = ptr, nbytes, version, arena, offset
            arena.users += 1
            self._cache[id(obj)] = entry
            self._by_place[(ptr, nbytes)] = entry
            return arena.handle, offset

    def let_go(self) -> None:
        """Close every arena now, whatever still uses it here (a rank's export to a replacement, once it has
        mapped them: its mappings keep the pages, this process keeps none)."""
        with self._lock:
            arenas = {id(e.arena): e.arena for e in self._cache.values()}
            arenas.update((id(a), a) for a in self._idle)
            self._cache.clear()
            self._by_place.clear()
            self._idle = []
            for arena in arenas.values():
                arena.close()

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._cache.pop(key, None)
            if entry is None:
                return
            if self._by_place.get((entry.ptr, entry.nbytes)) is entry:
                del self._by_place[(entry.ptr, entry.nbytes)]
            entry.arena.users -= 1
            if entry.arena.users == 0:
                self._idle.append(entry.arena)

    def changed_array(self, np, value) -> bool:
        """``value`` (a numpy array) went through an arena and its bytes have changed since. Under the lock:
        another thread's send may forget its entry and close its arena meanwhile."""
        with self._lock:
            entry = self._cache.get(id(value))
            if entry is None or entry.ref() is not value:
                return False
            lo, nbytes, src = _array_bytes(np, value)
            return (lo, nbytes) != (entry.ptr, entry.nbytes) or not _equal(entry, src())


def changed_array(value) -> bool:
    """A numpy array whose bytes went to the ranks through an arena and have changed since (it has no
    version counter; compared in full, ~0.3 s/GiB). False for anything else."""
    np = sys.modules.get("numpy")
    if np is None or type(value) is not np.ndarray or _sharer is None:
        return False
    return _sharer.changed_array(np, value)


def _equal(entry: _Entry, src) -> bool:
    import torch

    return bool(torch.equal(entry.arena.bytes_at(entry.offset, entry.nbytes), _as_tensor(src)))


_sharer: Sharer | None = None
_sharer_pid = 0


def sharer() -> Sharer:
    """This process's Sharer (a fork's copy of the kernel's is not used: made anew in each process)."""
    global _sharer, _sharer_pid
    if _sharer is None or _sharer_pid != os.getpid():
        _sharer, _sharer_pid = Sharer(), os.getpid()
    return _sharer


# -- what is shared, and how it is rebuilt in a rank ------------------------------------------------------------
def reduce(obj):
    """The pickler's reduction of a notebook tensor or array through an arena, or None (pickled as it is)."""
    if not enabled():
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda" and _gpu.get() and gpu_share is not None:
            reduced = gpu_share(obj)
            if reduced is not None:
                sharer().on_gpu += obj.untyped_storage().nbytes()
            return reduced
        return _reduce_tensor(torch, obj)
    np = sys.modules.get("numpy")
    if np is not None and type(obj) is np.ndarray:
        return _reduce_array(np, obj)
    return None


def _reduce_tensor(torch, t):
    if not plain_bytes(torch, t):
        return None
    storage = t.untyped_storage()

    def src():
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    handle, offset = sharer().place(t, storage.data_ptr(), storage.nbytes(), t._version, src)
    return _tensor, (handle, offset, tensor_meta(torch, t))


def plain_bytes(torch, t) -> bool:
    """``t`` is a plain CPU tensor (or parameter) whose storage's bytes, with ``tensor_meta``, make it again
    (``rebuilt``), large enough to be worth travelling apart from a pickle. A subclass keeps its own pickling."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return False
    return not (t.device.type != "cpu" or t.layout != torch.strided or t.is_nested or t.is_quantized or t.is_conj()
                or t.is_neg() or (t.requires_grad and not t.is_leaf)) and t.untyped_storage().nbytes() >= MIN_BYTES


def tensor_meta(torch, t) -> tuple:
    """What ``rebuilt`` needs besides the storage's bytes: its place on them, and the attributes it carries (its
    ``__dict__``: ``param._is_hf_initialized``..., as torch's own pickling keeps them)."""
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), t.storage_offset(),
            t.untyped_storage().nbytes(), t.requires_grad, type(t) is torch.nn.Parameter, dict(t.__dict__) or None)


def rebuilt(raw, meta):
    """The tensor ``tensor_meta`` described, on ``raw`` (a flat uint8 tensor holding its storage's bytes)."""
    import torch

    dtype_name, shape, stride, storage_offset, _nbytes, requires_grad, parameter, attributes = meta
    t = torch.empty(0, dtype=getattr(torch, dtype_name)).set_(raw.untyped_storage(), storage_offset, shape, stride)
    if parameter:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(requires_grad)
    t.__dict__.update(attributes or {})
    return t


def _reduce_array(np, a):
    if a.dtype.hasobject or a.nbytes < MIN_BYTES:
        return None
    lo, nbytes, src = _array_bytes(np, a)
    # an array has no version counter: its bytes are compared with the arena's copy at each send (~0.3 s/GiB)
    handle, offset = sharer().place(a, lo, nbytes, None, src, compare=True)
    meta = (a.dtype.str, a.shape, a.strides, a.__array_interface__["data"][0] - lo, nbytes)
    return _array, (handle, offset, meta)


def _array_bytes(np, a):
    """(address, size, a function giving them as a flat uint8 array) of the bytes ``a`` spans."""
    bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds
    lo, hi = bounds(a)

    def src():
        import ctypes

        return np.ctypeslib.as_array((ctypes.c_ubyte * (hi - lo)).from_address(lo))

    return lo, hi - lo, src


# -- the rank's side ---------------------------------------------------------------------------------------------
# (boot id, inode) -> its mmap here, while a value uses it
_mapped: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _open(handle: memfd.Handle) -> mmap.mmap:
    m = _mapped.get(handle.key)
    if m is not None:
        return m
    try:
        mine = memfd.open_handle(handle)
    except memfd.Replaced:
        raise RuntimeError("a notebook tensor sent through shared memory was let go by the kernel before this "
                           "rank opened it: send it again (rerun the cell)") from None
    except memfd.Unreachable as e:
        raise RuntimeError(f"a notebook tensor sent through shared memory could not be opened here ({e}): the "
                           "kernel that sent it is gone, or this rank runs on another machine") from None
    try:
        m = memfd.map_private(mine)
    finally:
        os.close(mine)
    _mapped[handle.key] = m
    return m


def _tensor(handle, offset, meta):
    return rebuilt(_bytes_of(_open(handle), meta[4], offset), meta)


def _array(handle, offset, meta):
    import numpy as np

    dtype, shape, strides, start, nbytes = meta
    m = _open(handle)
    flat = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=offset)
    return np.ndarray(shape, dtype=np.dtype(dtype), buffer=flat, offset=start, strides=strides)

