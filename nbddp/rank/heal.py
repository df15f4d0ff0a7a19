"""In a rank: a pool's state, vouched for, sent to a replacement, and what was bound to a dead group made anew.

When a pool loses a rank (kernel/healing/), a replacement is forked from the kernel: it has the notebook's
names, not what the pool's cells built. The survivors hold that state. Each is asked for a fingerprint of every
name its cells bound (``survey``): tensors and arrays by their layout, their words summed by position and a hash
of a sample spread over them (0.3 s a GiB, where hashing every byte would take seconds), everything else by its
pickle. A name whose fingerprint two or more survivors agree on is the pool's, not one rank's (a DDP model, its
optimizer, a tokenised dataset); a name they disagree on was made from ``rank`` (a shard, ``mine = rank * 10``),
and one only a single survivor holds cannot be vouched for: neither is ever given to the replacement.

One survivor then pickles the agreed names in one pickle (``export``: shared references survive, an optimizer
still points at its model's parameters), tensors and arrays through its own memfd arena
(wire/sharedtensor.py, as the notebook's go to ranks), which the replacement maps privately (``adopt``): one
copy, no pickle of the bytes, and the replacement's own memory grows only as it writes. A
``DistributedDataParallel`` travels as its module and options; after every rank is in the new process group,
``rebuild`` makes each DDP anew on it (same module, same options), on every rank, so a training loop goes on
unchanged.
"""
from __future__ import annotations

import contextvars
import functools
import hashlib
import io
import pickle
import sys
import types
import warnings

import cloudpickle

from ..wire import memfd, sharedtensor, values
from ..wire.messages import Result
from . import usergroup
from .jobs import in_namespace

SAMPLE_WORDS = 8192  # words of a tensor hashed, spread over it, beside its sums
COLUMNS = 1021  # a tensor's words summed in this many classes by position (a prime: strides rarely align)
_exported: list = []  # the export's arenas, held until every rank rebuilt (the replacement has mapped them)


class NotTransferable(TypeError):
    """A value no other rank can be given as it is (a process group, a shard); the message says why."""


class GroupBound(NotTransferable):
    """Bound to the process group and not made anew (a group of ``new_group``, a shard, a mesh that does not
    fit the new group): on a survivor too, it still uses the old group."""


# -- survey: a fingerprint per name -------------------------------------------------------------------------
class Step:
    """``fn(ctx, *args)`` on a rank, its value the answer (the kernel's mending steps, kernel/healing/steps.py)."""

    def __init__(self, fn, args, max_value_bytes: int):
        self.fn, self.args, self.max_value_bytes = fn, args, max_value_bytes

    def __call__(self, ctx) -> Result:
        return Result(value=values.pack(self.fn(ctx, *self.args), max_bytes=self.max_value_bytes))


def survey(ctx, notebook_too: bool = False) -> dict:
    """name -> (kind, what, tensors, owned) for each name this rank's cells bound (``ctx.owned``) that it holds, and
    with ``notebook_too`` the notebook's tensors, arrays, modules and optimizers it holds (a pool's cell may
    have changed them in place: ``model.to(...)``, a training loop). Kind "value" (its fingerprint), "remade"
    (what is made anew on the new group, ``rebuild``: a DDP, a DeviceMesh, a replicated DTensor; the
    fingerprint of what it is made from), "lost" or "bound" (why no peer can be given it; "bound": it uses the
    old group, on a survivor too). ``tensors``: the tensors it holds (ids in this rank), so a name holding one
    that a lacking name holds lacks too. Run on every survivor (and, ``notebook_too``, on a replacement: what
    the kernel's fork gave it)."""
    ns = ctx.namespace
    owned = set(ctx.owned or ())
    names = sorted(owned | ({n for n, v in ns.items() if _inherited_state(n, v)} if notebook_too else set()))
    out = {}
    for name in names:
        if name not in ns:
            continue
        kind = "remade" if _remade(ns[name]) else "value"
        met: list = []
        try:
            fp = fingerprint(ns[name], met)
        except NotTransferable as e:
            out[name] = ("bound" if isinstance(e, GroupBound) else "lost", str(e), (), name in owned)
            continue
        except Exception as e:  # noqa: BLE001 - any value a pickler refuses: that name is not healed, said why
            out[name] = ("lost", f"cannot be pickled ({type(e).__name__}: {e})", (), name in owned)
            continue
        if met[0].remade and kind != "remade":
            out[name] = ("lost", f"holds a {met[0].remade[0]} inside it, which is made anew only under a name of "
                         "its own: make it again", (), name in owned)
            continue
        out[name] = (kind, fp, tuple(met[0].tensors), name in owned)
    return out


def _inherited_state(name: str, value) -> bool:
    """A notebook name whose value a pool's cell may have changed in place and that costs no copy to
    fingerprint: tensors, arrays, modules, optimizers (never a list or dict of Python objects: reading those
    would copy their pages into the rank, reference counts being writes)."""
    if name.startswith("_"):
        return False
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    return (torch is not None and isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer))
            or np is not None and type(value) is np.ndarray)


def remade_names(ctx) -> list:
    """The names in the rank's namespace of what ``rebuild`` makes anew (DDP models, DeviceMeshes, replicated
    DTensors)."""
    return sorted(n for n, v in ctx.namespace.items() if not n.startswith("_") and _remade(v))


def _remade(value) -> str | None:
    """What kind of value bound to the process group ``rebuild`` makes anew, or None."""
    if isinstance(value, Pending):
        return value.kind
    names = {c.__name__ for c in type(value).__mro__}
    for kind in REMADE:
        if kind in names and (kind != "DTensor" or _replicated(value)):
            return kind
    return None


class _Hash(io.RawIOBase):
    def __init__(self):
        self.h = hashlib.blake2b(digest_size=16)

    def writable(self):
        return True

    def write(self, b):
        self.h.update(b)
        return len(b)


class _Fingerprinter(cloudpickle.CloudPickler):
    """A pickle of the value as it would travel, big data replaced by its sums, classes and functions of the
    pool's cells by their code and attributes (cloudpickle tags a class with a per-process id, which would make
    equal values differ). ``tensors``: the tensors met (ids: a name holding one that a name the replacement
    lacks holds must not be copied either: an optimizer and its model's parameters); ``ddps``: the DDP models
    met; ``remade``: the kinds met of what is made anew on the new group (``REMADE``)."""

    def __init__(self, file, **kw):
        super().__init__(file, **kw)
        self.tensors: set[int] = set()
        self.remade: list[str] = []

    def reducer_override(self, obj):
        special = _special(obj)
        if special is not None:
            self.remade.append(special[0].kind)
            return special
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            if obj.requires_grad and not obj.is_leaf:
                raise NotTransferable("a tensor inside an autograd graph (a loss, an output): compute it again")
            self.tensors.add(id(obj))
            return _tensor_sums(torch, obj)
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray and not obj.dtype.hasobject:
            return _sums, ("ndarray", obj.dtype.str, obj.shape, *_word_sums(torch, np, obj))
        if isinstance(obj, type) and obj.__module__ == "__main__":
            return _sums, ("class", obj.__qualname__, tuple(
                (k, v) for k, v in sorted(vars(obj).items()) if k not in ("__dict__", "__weakref__")))
        return _cell_function(obj) or super().reducer_override(obj)


def fingerprint(value, pickler_out: list | None = None) -> str:
    """Without pickle's memo where it can (its back-references follow object identity: a string interned on one
    rank and unpickled on another, the replacement of an earlier heal, would make equal values differ); a value
    with a cycle needs the memo (a false "differs" only leaves a name to run again, never a wrong copy).
    ``pickler_out``: given a list, the pickler is appended (what it met: ``tensors``, ``remade``)."""
    for fast in (True, False):
        h = _Hash()
        pickler = _Fingerprinter(h, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.fast = fast
        try:
            pickler.dump(value)
        except ValueError:
            if not fast:
                raise
            continue  # ("fast mode: can't pickle cyclic objects")
        if pickler_out is not None:
            pickler_out.append(pickler)
        return h.h.hexdigest()


def _sums(*parts):  # never called: a fingerprint is only hashed
    return parts


def _tensor_sums(torch, t):
    t = t.detach()
    if t.is_quantized:
        parts = (_raw_sums(torch, _bytes(torch, t.int_repr())), t.qscheme(), repr(t.q_per_channel_scales().tolist()
                 if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric) else t.q_scale()))
    elif t.layout != torch.strided:  # sparse: its indices and values
        c = t.coalesce() if t.layout == torch.sparse_coo else t.to_sparse_coo().coalesce()
        parts = (_raw_sums(torch, _bytes(torch, c.indices())), _raw_sums(torch, _bytes(torch, c.values())))
    else:
        parts = _raw_sums(torch, _bytes(torch, t))
    return _sums, ("tensor", str(t.dtype), str(t.layout), tuple(t.shape), str(t.device), t.requires_grad, parts)


def _bytes(torch, t):
    """A tensor's elements as flat bytes, starting at an 8-byte boundary (a view at another offset is copied)."""
    raw = t.reshape(-1).contiguous().view(torch.uint8)
    return raw if raw.storage_offset() % 8 == 0 else raw.clone()


def _word_sums(torch, np, a):
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return _raw_sums(torch, torch.from_numpy(raw).clone() if raw.ctypes.data % 8 else torch.from_numpy(raw)) \
        if torch is not None else (hashlib.blake2b(raw).hexdigest(),)


def _raw_sums(torch, raw) -> tuple:
    """The bytes as 64-bit words, summed in ``COLUMNS`` classes by position (a one-hot at ``rank``, two elements
    swapped, a shuffle: each moves a word to another class), the first half's sum, and a hash of 8,192 words
    spread over them, plus the bytes that do not fill a word. One pass and a half: 0.3 s a GiB on one thread."""
    n = raw.numel()
    cut = n - n % 8
    words = raw[:cut].view(torch.int64)
    m = words.numel()
    whole = m - m % COLUMNS
    columns = words[:whole].view(-1, COLUMNS).sum(0).cpu().numpy().tobytes() if whole else b""
    sample = words[::max(1, m // SAMPLE_WORDS)][:SAMPLE_WORDS].cpu().numpy().tobytes()
    return (hashlib.blake2b(columns, digest_size=16).hexdigest(), int(words[whole:].sum()),
            int(words[:m // 2].sum()), hashlib.blake2b(sample, digest_size=16).hexdigest(),
            bytes(raw[cut:].cpu().numpy()), n)


def _special(obj):
    """What no peer may be given, refused with why; what is bound to the process group as what makes it anew
    (a ``Pending``: a DDP model's module and options, a DeviceMesh's shape, a replicated DTensor's local tensor)."""
    kind = type(obj)
    if kind.__module__ == "builtins":  # (asked of every object pickled: a list of a million strings too)
        return None
    names = {c.__name__ for c in kind.__mro__}
    if "DistributedDataParallel" in names:
        return PendingDDP, (obj.module, ddp_options(obj))
    if "DeviceMesh" in names:
        return PendingMesh, _mesh_args(obj)
    if "DTensor" in names and _replicated(obj):  # every rank holds all of it: the new rank may too
        local = obj._local_tensor.detach()
        return PendingDTensor, (local, obj.device_mesh, tuple(obj.placements), obj.requires_grad)
    if "ProcessGroup" in names:
        raise GroupBound(f"a {kind.__name__} belongs to its process group: make it again on the new group")
    if "DTensor" in names or "FSDPModule" in names or "FullyShardedDataParallel" in names:
        raise GroupBound("sharded (FSDP2 / DTensor): the lost rank's shards went with it; load the last "
                              "torch.distributed.checkpoint (dcp.load, resharded) on every rank")
    return None


def _replicated(dtensor) -> bool:
    return all(type(p).__name__ == "Replicate" for p in dtensor.placements)


# -- what is bound to the process group travels as what makes it; it is made anew on the new group ----------------
REMADE = ("DeviceMesh", "DTensor", "DistributedDataParallel")  # in the order ``rebuild`` makes them


class Pending:
    """What ``rebuild`` makes anew once the process group is whole; ``kind``: one of ``REMADE``."""

    kind = ""

    def __repr__(self):
        return f"Pending{self.kind}(made anew once the pool's group is whole)"


class PendingDDP(Pending):
    kind = "DistributedDataParallel"

    def __init__(self, module, options: dict):
        self.module, self.options = module, options


class PendingMesh(Pending):
    kind = "DeviceMesh"

    def __init__(self, device_type: str, shape: tuple, dim_names):
        self.device_type, self.shape, self.dim_names = device_type, shape, dim_names


class PendingDTensor(Pending):
    kind = "DTensor"

    def __init__(self, local, mesh, placements: tuple, requires_grad: bool):
        self.local, self.mesh, self.placements, self.requires_grad = local, mesh, placements, requires_grad


def _mesh_args(mesh) -> tuple:
    """A DeviceMesh as what makes it on the current group: a mesh over every rank (``init_device_mesh``'s); a
    one-dimensional one follows the group's size (a pool shrunk or resized)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    layout = mesh.mesh.reshape(-1).tolist()
    shape = tuple(mesh.mesh.shape)
    if len(shape) == 1 and layout == list(range(len(layout))):
        return mesh.device_type, (world,), mesh.mesh_dim_names
    if layout != list(range(world)):
        raise GroupBound(f"a DeviceMesh of shape {shape} over ranks {layout[:8]} cannot be made on a group of "
                              f"{world}: make it again")
    return mesh.device_type, shape, mesh.mesh_dim_names


def ddp_options(ddp) -> dict:
    """What a DistributedDataParallel was made with, to make it again (its group: the default one)."""
    options = {
        "device_ids": ddp.device_ids,
        "output_device": ddp.output_device,
        "dim": ddp.dim,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": getattr(ddp, "static_graph", False),
    }
    cap = getattr(ddp, "bucket_bytes_cap", None)
    if cap is not None:
        options["bucket_cap_mb"] = cap / (1024 * 1024)
    if not ddp.broadcast_buffers:  # (only where it was turned off: torch 2.13 warns whenever it is given)
        options["broadcast_buffers"] = False
    return options


# -- export and adopt -----------------------------------------------------------------------------------------
class _Exporter(values.RankPickler):
    """The agreed names for a new rank. Tensors it will write at every step (parameters, what optimizers keep)
    travel by value, into its own memory; the rest through this rank's arena, mapped privately there: a written
    page of the arena would be copied, and the arena's own page kept beside it for the new rank's life. GPU
    tensors go by CUDA IPC on this machine (``export``), each copied at once on the new rank's GPU, device to
    device (hw/cuda.py's ``opened_on_rank``): never through the host."""

    def __init__(self, file, written: set, **kw):
        super().__init__(file, **kw)
        self.written = written

    def reducer_override(self, obj):
        special = _special(obj) or _cell_function(obj)
        if special is not None:
            return special
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cuda" and (
                obj.requires_grad or id(obj) in self.written):
            return cloudpickle.CloudPickler.reducer_override(self, obj)  # (torch's own pickle: by value)
        return super().reducer_override(obj)  # a GPU tensor: by CUDA IPC, copied on the GPU by the new rank


def _optimizer_state(values_) -> set:
    """The ids of the tensors the optimizers among ``values_`` keep (their moments, step counts)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return set()
    return {id(t) for opt in values_ if isinstance(opt, torch.optim.Optimizer)
            for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)}


def _cell_function(obj):
    """A function a cell defined (``__main__``, no closure): its code and defaults, not the values of the
    globals it names. Those are each rank's own (``shard``): the function runs against the namespace it
    lands in (``adopt``), as it did against the peer's, and its fingerprint is the same on every rank."""
    if (type(obj) is types.FunctionType and obj.__module__ == "__main__" and obj.__closure__ is None
            and obj.__name__ != "<lambda>"):
        return _main_function, (obj.__code__, obj.__name__, obj.__qualname__, obj.__defaults__, obj.__kwdefaults__,
                                obj.__doc__, obj.__dict__ or None)
    return None


_landing: contextvars.ContextVar = contextvars.ContextVar("nbddp_heal_landing", default=None)


def _main_function(code, name, qualname, defaults, kwdefaults, doc, attrs):
    """A cell's function, rebuilt against the namespace it lands in (``adopt``'s), as if defined there."""
    ns = _landing.get()
    fn = types.FunctionType(code, ns if ns is not None else {"__name__": "__main__"}, name, defaults)
    fn.__qualname__, fn.__kwdefaults__, fn.__doc__, fn.__module__ = qualname, kwdefaults, doc, "__main__"
    if attrs:
        fn.__dict__.update(attrs)
    return fn


def export(ctx, names) -> bytes:
    """``names`` of this rank's namespace in one pickle, tensors and arrays through this rank's memfd arenas
    (kept open until ``rebuild``, by which time the replacement has mapped them), those written at every step
    by value (``_Exporter``)."""
    sharer = sharedtensor.sharer()
    with sharer.send(), sharedtensor.handing_gpu(True):
        buf = _pickled(ctx.namespace, names)
    _exported.append(sharer)
    return buf.getvalue()


def _pickled(ns, names, raw: list | None = None) -> io.BytesIO:
    """``names`` of ``ns`` in one pickle (``_Exporter``); where its tensors go is the caller's context (an arena
    of this rank's, or by value for another machine). ``raw``: large CPU tensors and arrays are left out of the
    pickle, their bytes appended here to be sent as they are (``_Sender``)."""
    chosen = {n: ns[n] for n in names}
    buf = io.BytesIO()
    kind = _Exporter if raw is None else functools.partial(_Sender, raw=raw)
    kind(buf, _optimizer_state(chosen.values()), protocol=pickle.HIGHEST_PROTOCOL).dump(chosen)
    return buf


class _Sender(_Exporter):
    """For a new rank on another machine: each large CPU tensor's storage and each large array's bytes go as they
    are, after the pickle, over the process group (``give``), and the pickle holds only where each lands and its
    layout. No copy of them is made here (the pickle by value took one, ``pickle.loads`` another, and 1 GiB took
    15 s across two Ray nodes); tensors that are views of one storage share it there as here (an array arrives
    as a contiguous array of its own)."""

    def __init__(self, file, written: set, raw: list, **kw):
        super().__init__(file, written, **kw)
        self.raw, self.storages = raw, {}

    def reducer_override(self, obj):  # (plain tensors and arrays only: nothing ``_special`` would take)
        sent = self._tensor(obj) or self._array(obj)
        return sent if sent is not None else super().reducer_override(obj)

    def _slot(self, key, data) -> int:
        if key not in self.storages:
            self.storages[key] = len(self.raw)
            self.raw.append(data)
        return self.storages[key]

    def _tensor(self, t):
        torch = sys.modules.get("torch")
        if torch is None or not sharedtensor.plain_bytes(torch, t):
            return None
        storage = t.untyped_storage()
        slot = self._slot(("tensor", storage.data_ptr(), storage.nbytes()),
                          torch.empty(0, dtype=torch.uint8).set_(storage))
        return _arrived_tensor, (slot, sharedtensor.tensor_meta(torch, t))

    def _array(self, a):
        np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        if (np is None or torch is None or type(a) is not np.ndarray or a.dtype.hasobject
                or a.nbytes < sharedtensor.MIN_BYTES):
            return None
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # (a copy only where it is not contiguous)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only array: only read here
            data = torch.from_numpy(flat)
        return _arrived_array, (self._slot(("array", id(a)), data), (a.dtype, a.shape))


_arrivals: contextvars.ContextVar = contextvars.ContextVar("nbddp_heal_arrivals", default=())


def _arrived_tensor(slot: int, meta):
    return sharedtensor.rebuilt(_arrivals.get()[slot], meta)


def _arrived_array(slot: int, meta):
    import numpy as np

    dtype, shape = meta
    return _arrivals.get()[slot].numpy().view(np.dtype(dtype)).reshape(shape)  # (contiguous: its own copy)


def give(ctx, names, to) -> int:
    """A pool across machines (a survivor's): ``names`` sent to each rank of ``to`` over the new process group,
    point to point, never through the kernel: one pickle (by value: the new ranks cannot open this machine's
    memfds) without the large tensors and arrays, whose bytes follow it as they are (``_Sender``); ``take``
    receives them. Returns the bytes sent to each."""
    import torch
    import torch.distributed as dist

    raw: list = []
    with memfd.elsewhere():
        buf = _pickled(ctx.namespace, names, raw)
    parts = [torch.frombuffer(buf.getbuffer(), dtype=torch.uint8), *raw]  # (a pickle is never empty)
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    for rank in to:
        dist.send(torch.tensor([len(parts)], dtype=torch.int64), rank)
        dist.send(sizes, rank)
        for part in parts:
            dist.send(part, rank)
    return int(sizes.sum())


def take(ctx, peer: int, lacking) -> list:
    """A new rank's, in a pool across machines: what ``give`` sends from ``peer``, adopted."""
    import torch
    import torch.distributed as dist

    count = torch.zeros(1, dtype=torch.int64)
    dist.recv(count, peer)
    sizes = torch.zeros(int(count.item()), dtype=torch.int64)
    dist.recv(sizes, peer)
    parts = [torch.empty(int(n), dtype=torch.uint8) for n in sizes.tolist()]
    for part in parts:
        dist.recv(part, peer)
    return adopt(ctx, memoryview(parts[0].numpy()), lacking, parts[1:])


def adopt(ctx, blob: bytes | None, lacking, arrived=()) -> list:
    """The replacement's: the peer's names into its namespace, and the names it must not have (the pool's cells
    bound them, no peer could vouch for a value) out of it, so the notebook's value never stands in.
    ``arrived``: the bytes ``give`` sent after the pickle (large tensors and arrays), which it points to."""
    ns = ctx.namespace
    landing, arrivals = _landing.set(ns), _arrivals.set(tuple(arrived))
    try:
        got = pickle.loads(blob) if blob is not None else {}
    finally:
        _landing.reset(landing)
        _arrivals.reset(arrivals)
    for name, value in got.items():
        ns[name] = in_namespace(value, ns) if isinstance(value, type) else value
    for name in lacking:
        ns.pop(name, None)
    ctx.owned.update(got)
    return sorted(got)


def rebuild(ctx, names) -> list:
    """Each of ``names`` made anew on the current group, meshes first, then replicated DTensors on them, then
    DDP models (in this order on every rank: a mesh's groups and DDP's constructor are collectives): what a
    peer sent (a ``Pending``), or what is bound to a group that is gone. An old DDP is kept until the rank is
    idle (usergroup: freeing it could deadlock). The export's arenas are let go (the replacement mapped them
    before). Returns (name, kind) for each made anew, (name, kind, why) for each that cannot be (a mesh, or
    what is on one, that does not fit the group: a 2-D mesh after a shrink)."""
    for sharer in _exported:
        sharer.let_go()
    _exported.clear()
    ns = ctx.namespace
    meshes: dict[int, object] = {}  # id of an old mesh (or its Pending) -> the new one
    made = []
    for name in sorted(names, key=lambda n: (REMADE.index(_remade(ns.get(n)) or REMADE[-1]), n)):
        kind = _remade(ns.get(name))
        if kind is None:
            continue
        try:
            ns[name] = _made_anew(ns[name], kind, meshes)
        except GroupBound as e:  # a mesh that does not fit the group (alike on every rank: skipped on every rank)
            made.append((name, kind, str(e)))
            continue
        made.append((name, kind))
    return made


def _made_anew(value, kind: str, meshes: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    def mesh_for(old):
        if id(old) not in meshes:
            device_type, shape, dim_names = (old.device_type, old.shape, old.dim_names) if isinstance(
                old, PendingMesh) else _mesh_args(old)
            meshes[id(old)] = init_device_mesh(device_type, shape, mesh_dim_names=dim_names)
        return meshes[id(old)]

    if kind == "DeviceMesh":
        return mesh_for(value)
    if kind == "DTensor":
        local, mesh, placements, grad = ((value.local, value.mesh, value.placements, value.requires_grad)
                                         if isinstance(value, PendingDTensor) else
                                         (value._local_tensor.detach(), value.device_mesh, tuple(value.placements),
                                          value.requires_grad))
        made = DTensor.from_local(local, mesh_for(mesh), placements, run_check=False)
        return made.requires_grad_() if grad else made
    if isinstance(value, PendingDDP):
        return DDP(value.module, **value.options)
    usergroup.keep(value)
    return DDP(value.module, **ddp_options(value))
