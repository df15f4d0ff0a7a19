"""Notebook values sent to ranks by value, each pickled once in the kernel, one that cannot be named
with why, through one worklist (``pickled_for_ranks``; a pool's cell: ``pickled_for_cell``): the globals
a spawned rank's cell reads (``ship_globals``), and what a pool's ranks do not have yet: ``RankNames``, the
one home of what they hold of the notebook's names (what they were sent, what they bound themselves, what
the pool's cells read, what the notebook rebound, what a cluster pool's other nodes lack)."""
from __future__ import annotations

import builtins
import sys
import types
import weakref
from dataclasses import dataclass, field

from ...errors import UsageError
from ...ipy.cellcode import names_used, notebook_name, split_last_expression
from ...units import size
from ...wire import memfd, sharedtensor, values


class Blobs(dict):
    """name -> a notebook value pickled for the ranks; ``shared``: name -> the bytes of its tensors and
    arrays that went through shared memory instead (sharedtensor.py), where there were any."""

    def __init__(self, *args):
        super().__init__(*args)
        self.shared: dict[str, int] = {}
        self.on_gpu: dict[str, int] = {}  # name -> bytes of the kernel's GPU tensors handed over by CUDA IPC

    def update(self, other=(), **kw):
        super().update(other, **kw)
        self.shared.update(getattr(other, "shared", {}))
        self.on_gpu.update(getattr(other, "on_gpu", {}))


def pickled_for_ranks(names, namespace: dict, *, wanted=None, unsendable) -> Blobs:
    """The one worklist that sends notebook values by value: each of ``names`` the namespace holds (a
    notebook name, and ``wanted(name, value)``), pickled once, then the notebook names a function or class
    among them reads (what it reads, in turn), as they are found. ``unsendable(name, value, error)``
    raises the UsageError for a value that cannot be pickled, or returns to let that name go. Big tensors
    and arrays among them go through shared memory, all of this send's in one memfd."""
    out = Blobs()
    tried: set[str] = set()
    pending = sorted(names)
    with sharedtensor.sharer().send() as sharer:
        while pending:
            name = pending.pop(0)
            if name in tried or name not in namespace or not notebook_name(name):
                continue
            tried.add(name)
            value = namespace[name]
            if wanted is not None and not wanted(name, value):
                continue
            before, gpu_before = sharer.shared, sharer.on_gpu
            try:
                out[name] = values.to_ranks(value)
            except sharedtensor.SharedMemoryFull as e:
                raise UsageError(f"`{name}` ({values.describe(value)}) must reach the ranks through shared memory, "
                                 f"and there is no room for its {e} more: the machine's memory is full. Nothing ran. "
                                 "Free memory in the notebook (del what you no longer need, then gc.collect()), or "
                                 "create it inside a %%ddp cell.") from None
            except Exception as e:  # noqa: BLE001 - named by ``unsendable``
                unsendable(name, value, e)
                continue
            if sharer.shared > before:
                out.shared[name] = sharer.shared - before
            if sharer.on_gpu > gpu_before:
                out.on_gpu[name] = sharer.on_gpu - gpu_before
            pending += sorted(reads_of(value) - tried)  # its globals: the rank's own once it arrives
    return out


def sent_text(blobs: dict[str, bytes], namespace: dict) -> list[str]:
    """``name (what it is, its size)`` for each value sent, but modules (a module travels by name); a
    value whose tensors went through shared memory, with how much of it did."""
    shared, on_gpu = getattr(blobs, "shared", {}), getattr(blobs, "on_gpu", {})

    def how(name, blob):
        if on_gpu.get(name):
            return f"{size(on_gpu[name])} by CUDA IPC"
        return f"{size(shared[name])} in shared memory" if shared.get(name) else size(len(blob))

    return [f"{name} ({values.describe(namespace[name])}, {how(name, blob)})" for name, blob in blobs.items()
            if not isinstance(namespace[name], types.ModuleType)]


def gpu_note(blobs) -> list[str]:
    """What handing the kernel's GPU tensors to the ranks costs, once a send has any."""
    if not getattr(blobs, "on_gpu", None):
        return []
    return [f"the kernel's GPU tensors ({', '.join(blobs.on_gpu)}) reach the ranks by CUDA IPC, copied device to "
            "device; a rank on another GPU than the tensor's opens it there: one more CUDA context on that GPU in "
            "the rank (300-500 MiB) while it copies"]


def reached(names, namespace: dict) -> set[str]:
    """``names`` and the notebook names the functions and classes among them read, in turn."""
    found, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if name not in found and name in namespace:
            found.add(name)
            pending += reads_of(namespace[name])
    return found


def pickled_for_cell(cell_reads, reads, namespace: dict, *, wanted, refuse, let_go_before: dict):
    """A pool cell's worklist: what it reaches (``cell_reads`` and what the notebook functions among them
    read) is pickled or the cell refused (``refuse(name, value, error)`` raises); what the pool's earlier
    cells read (``reads``) is pickled where it can be, and let go where not, but for a value already let go
    (``let_go_before``: name -> its token). Returns (name -> pickled value, name -> (token, why) let go now)."""
    near = reached(cell_reads, namespace)
    with sharedtensor.sharer().send():  # one memfd for the whole send
        blobs = pickled_for_ranks(near, namespace, wanted=wanted, unsendable=refuse)
        let_go: dict[str, tuple] = {}

        def note(name, value, e):
            let_go[name] = (_token(value), f"{type(e).__name__}: {e}")

        blobs.update(pickled_for_ranks(set(reads) - near - set(blobs), namespace, unsendable=note,
                                       wanted=lambda name, value: name not in blobs and wanted(name, value)
                                       and not _same(let_go_before.get(name), value)))
    return blobs, let_go


def ship_globals(source: str, filename: str, user_ns: dict, *, method: str = "spawn", advice: str = ".",
                 gpu_ipc: bool = False) -> Blobs:
    """The globals a spawned (or forkserver) rank needs, each pickled by value (a module by name), with the
    names a notebook function or class among them reads; an unsendable one is named, with the start
    method's ``advice`` (its starter's, kernel/ranks/starters.py). ``gpu_ipc``: GPU ranks of the forkserver,
    which get the kernel's GPU tensors by CUDA IPC."""
    body, last = split_last_expression(source, filename)

    def refuse(name, value, e):
        raise UsageError(
            f"--start-method {method} must send the global `{name}` ({values.describe(value)}) to every "
            f"rank, but it cannot be pickled:\n  {type(e).__name__}: {e}\n"
            f"Create `{name}` inside the cell{advice}"
        ) from None

    with sharedtensor.handing_gpu(gpu_ipc):
        return pickled_for_ranks(names_used(body) | (names_used(last) if last else set()), user_ns,
                                 wanted=lambda name, value: not (hasattr(builtins, name)
                                                                 and value is getattr(builtins, name)),
                                 unsendable=refuse)


def shipped_notes(blobs: Blobs, namespace: dict) -> list[str]:
    """What a one-shot cell that sends the notebook's globals says: the large ones, and CUDA IPC's cost."""
    big = Blobs({k: v for k, v in blobs.items()
                 if len(v) >= BIG_UPDATE or blobs.shared.get(k, 0) >= BIG_UPDATE or k in blobs.on_gpu})
    big.shared, big.on_gpu = blobs.shared, blobs.on_gpu
    sizes = sent_text(big, namespace)
    return ([f"sent {', '.join(sizes)} to every rank"] if sizes else []) + gpu_note(blobs)


BIG_UPDATE = 16 * 2**20  # a sent value this large earns the hint that %ddp restart shares it instead


@dataclass
class Changes:
    """What a pool cell sends: ``updates`` (name -> pickled value), ``dropped`` (names the ranks must
    forget: rebound in the notebook to a value that cannot be sent, and not read by this cell), and what
    to say about them; a cluster pool's ``for_other_nodes``: the values only the other nodes' ranks lack."""

    updates: dict = field(default_factory=dict)
    dropped: tuple = ()
    notes: list = field(default_factory=list)
    let_go: dict = field(default_factory=dict)  # name -> the token of the value that could not be sent
    for_other_nodes: dict = field(default_factory=dict)  # name -> pickled value, for the other nodes' ranks once


class RankNames:
    """What a pool's ranks hold of the notebook's names, in one place: the values they were sent (or
    shared at the start), the names they bound themselves, what the pool's cells read, what the notebook
    rebound since; for a pool across nodes (``across_nodes``), what the other nodes' ranks still lack (the
    kernel's node shares the notebook copy-on-write, the others start with nothing of it). One method per
    event: a notebook cell bound names (``notebook_bound``), a pool cell is about to run (``before_cell``,
    then ``sent`` once it goes), a pool cell answered (``answered``), values came back into the notebook
    (``came_back``).

    A name the notebook created or rebound since the pool started (or since it was last sent) is sent
    again, even to an equal value; one the ranks assigned themselves stays theirs unless the notebook
    rebinds it too (last writer wins). A function or class the notebook defined brings the notebook names
    its code reads that the ranks lack. Only a cell that reads a name is refused when its new value cannot
    be pickled: for the others the ranks' old copy is dropped (the notebook has moved on from it), said once."""

    def __init__(self, namespace: dict | None, *, across_nodes: bool = False, inherited: bool = True,
                 gpu_ipc: bool = False):
        """``inherited``: the ranks were forked from the kernel and hold its names as they were (a
        forkserver's ranks hold none: every name a cell reads is sent at its first use); ``gpu_ipc``: the
        forkserver's GPU ranks, which get the kernel's GPU tensors by CUDA IPC."""
        self.gpu_ipc = gpu_ipc
        self.across_nodes = across_nodes
        self.namespace = namespace if namespace is not None else {}
        # name -> the value the ranks have
        self.known = {k: _token(v) for k, v in self.namespace.items()} if inherited else {}
        self.unsendable: dict[str, tuple] = {}  # name -> the value dropped from the ranks (it cannot be sent)
        self.assigned: set[str] = set()  # names the ranks bound themselves: theirs until the notebook rebinds them
        self.reads: set[str] = set()  # every name the pool's cells' code reads, functions' bodies too
        # a pool across nodes: the notebook names the other nodes' ranks lack, and those that could not be sent
        self.lacking = {k for k in self.namespace if notebook_name(k)} if across_nodes else set()
        # name -> the value not sent to the other nodes (not tried again)
        self.unsendable_elsewhere: dict[str, tuple] = {}

    # -- events ------------------------------------------------------------------------------------------
    def notebook_bound(self, names) -> None:
        """Names a notebook cell just bound (an assignment, def, import...): sent at the next cell that
        reads them, whatever their value."""
        for name in names:
            self.known.pop(name, None)

    def came_back(self, names) -> None:
        """Names the notebook just received from the ranks (--out, --gather): not changes to send back."""
        for name in names:
            if name in self.namespace:
                self.known[name] = _token(self.namespace[name])

    def before_cell(self, cell_reads, *, nodes_running: bool = False) -> Changes:
        """What must go with a cell that reads ``cell_reads`` (a function an earlier cell defined reads
        its globals when a later cell calls it, so the pool's earlier cells' reads count too). Nothing is
        marked sent until ``sent``: the cell may yet be refused. ``nodes_running``: a running pool across
        nodes, whose other nodes get what they lack once (``Changes.for_other_nodes``)."""
        self.reads |= cell_reads
        # a pool across nodes: its ranks elsewhere cannot open this machine's memfds, so tensors are pickled
        # by value and shared buffers carry their bytes (once per node)
        with memfd.elsewhere(self.across_nodes):
            with sharedtensor.handing_gpu(self.gpu_ipc):
                changes = self._changes(cell_reads)
            if nodes_running:
                with memfd.elsewhere():  # (their ranks cannot open this machine's memfds)
                    changes.for_other_nodes = self._lacked_by_other_nodes(cell_reads)
            sizes = sent_text(changes.for_other_nodes, self.namespace)
            if sizes:
                changes.notes.append(f"sent {', '.join(sizes)} to the other nodes' ranks, once (they do not share "
                                     "the notebook's memory)")
        return changes

    def sent(self, changes: Changes) -> None:
        """The cell that carries ``changes`` goes to the ranks: what it sends and drops is theirs now (and
        no longer the ranks' own)."""
        for name in changes.updates:
            self.known[name] = _token(self.namespace[name])
            self.unsendable.pop(name, None)
        self.unsendable.update(changes.let_go)
        self.assigned -= {*changes.updates, *changes.dropped}
        self.lacking -= set(changes.updates)  # (sent to every node)

    def joined_empty(self) -> None:
        """A rank that holds none of the notebook's names joined (a forkserver pool's replacement for a lost
        rank): every notebook name the pool's cells read goes again with the next cell, except the ranks' own."""
        self.known = {name: _token(self.namespace[name]) for name in self.assigned if name in self.namespace}

    def joined_elsewhere(self) -> None:
        """A rank on another node joined with none of the notebook's names (a pool across nodes: a replacement
        for a lost rank): those the pool's cells read go to the other nodes again with the next cell."""
        self.lacking = {k for k in self.namespace if notebook_name(k)}

    def answered(self, per_rank) -> None:
        """The ranks' ``Result``s of a pool cell: the names each bound are the ranks' own now."""
        for res in per_rank:
            self.assigned |= set(res.assigned)

    # -- what goes with a cell ---------------------------------------------------------------------------
    def _changes(self, cell_reads) -> Changes:
        namespace = self.namespace

        def refuse(name, value, e):
            raise UsageError(f"`{name}` changed in the notebook since %ddp start and this cell reads it, so it "
                             f"must be sent to every rank, but it cannot be pickled: {type(e).__name__}: {e}\n"
                             "Nothing ran. Create it inside a %%ddp cell, or %ddp restart (the ranks then share "
                             "it).") from None

        updates, let_go = pickled_for_cell(cell_reads, self.reads, namespace, refuse=refuse,
                                           let_go_before=self.unsendable,
                                           wanted=lambda name, value: not _same(self.known.get(name), value))
        notes = [f"`{name}` was rebound in the notebook to {values.describe(namespace[name])}, which cannot be sent "
                 f"to the ranks ({why}); the ranks' old `{name}` is dropped, and a cell that reads `{name}` (or calls "
                 "a notebook function that does) will be refused until it can be sent"
                 for name, (_, why) in let_go.items()]
        sizes = sent_text(updates, namespace)
        if sizes:
            total = sum(len(b) for b in updates.values())  # pickled: what shared memory did not carry
            notes.insert(0, f"sent {', '.join(sizes)} to every rank (new or rebound in the notebook since the pool "
                         "started)" + ("; %ddp restart shares big data copy-on-write instead" if total >= BIG_UPDATE
                                       else ""))
        notes += gpu_note(updates)
        both = [name for name in updates if name in self.assigned  # (`import nbddp` in both: one module, no change)
                and not isinstance(namespace.get(name), types.ModuleType)]
        if both:
            notes.append(f"{', '.join(both)} changed both in the notebook and on the ranks: the ranks now use "
                         "the notebook's value")
        return Changes(updates, tuple(let_go), notes, {name: token for name, (token, _) in let_go.items()})

    def _lacked_by_other_nodes(self, cell_reads) -> dict[str, bytes]:
        """The notebook values the other nodes' ranks lack that the pool's cells read (with what a notebook
        function among them reads), pickled once. Only a cell that reads one that cannot be pickled is
        refused (the other nodes' ranks never had it); the others are tried again if they change."""
        def refuse(name, value, e):
            raise UsageError(f"`{name}` must be sent to the pool's ranks on the other nodes (they do not share "
                             f"the notebook's memory), but it cannot be pickled: {type(e).__name__}: {e}\n"
                             "Nothing ran. Create it inside a %%ddp cell.") from None

        sent, let_go = pickled_for_cell(cell_reads, self.reads, self.namespace, refuse=refuse,
                                        let_go_before=self.unsendable_elsewhere,
                                        wanted=lambda name, value: name in self.lacking and name not in self.assigned)
        self.unsendable_elsewhere.update({name: token for name, (token, _) in let_go.items()})
        self.lacking -= set(sent)
        return sent


def _token(value):
    """What identifies the value the ranks hold: equal plain values; the same object; for a tensor, also
    its version (an in-place change in the notebook moves it: the next cell that reads it gets it anew)."""
    if isinstance(value, values.PLAIN):
        return ("v", type(value), value)
    version = _revision(value)
    try:
        return ("w", weakref.ref(value), version)
    except TypeError:
        return ("i", id(value))


def _revision(value):
    """A tensor's version counter (in-place ops move it); a numpy array whose bytes changed since they were
    sent through shared memory: a fresh token (it never equals); anything else: None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            return value._version
        except RuntimeError:  # an inference tensor has none
            return None
    if sharedtensor.changed_array(value):
        return object()
    return None


def _same(token, value) -> bool:
    if token is None:
        return False
    kind = token[0]
    if kind == "v":
        return type(value) is token[1] and value == token[2]
    if kind == "w":
        return token[1]() is value and token[2] == _revision(value)
    return token[1] == id(value)


def reads_of(value) -> set[str]:
    """The global names a function or class the notebook defined reads (none for other values)."""
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        return names_used(value.__code__)
    if isinstance(value, type) and value.__module__ == "__main__":
        found = set()
        for attr in vars(value).values():
            func = getattr(attr, "__func__", attr)
            if isinstance(func, types.FunctionType):
                found |= names_used(func.__code__)
        return found
    return set()

