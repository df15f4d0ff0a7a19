"""The CUDA seam: the only module that talks to CUDA, in the kernel or in a rank.

In the kernel nbddp must never initialise CUDA, nor even load the driver library (a forked child of a
process with a CUDA context cannot use the GPU). So this module only *watches*: it sets
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (so ``torch.cuda.is_available()`` asks NVML instead of creating a
context), wraps torch's lazy CUDA init to record which cell and line created the context (and which
library, when a library called it), and has ``driverwatch`` note after each cell whether the driver
library got mapped or a driver device opened, by which cell and module. Before a GPU fork, ``refusal()``
decides: torch's own record first; otherwise, wherever the driver is mapped, a throwaway forked child
tries ``cuInit`` (once per cell), which fails only if this process holds a context. The watcher's
sightings then name the cell and module. A mapped driver or an open device file alone proves nothing:
torch 2.11's CUDA wheels map the driver on import, and NVML opens the same device files (seen on an
H100). Tests swap the whole seam with ``use(stand_in)``.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
import traceback
from dataclasses import dataclass

from ..errors import CudaInitialisedError
from . import driverwatch


@dataclass(frozen=True)
class InitSite:
    cell: str  # "In [5]" or a file name
    line: int | None
    code: str
    module: str | None = None  # the library whose call created the context, when not the cell itself

    def __str__(self) -> str:
        where = f"{self.cell}, line {self.line}" if self.line else self.cell
        where = f"{where}: {self.code}" if self.code else where
        return f"{where} (inside module {self.module})" if self.module else where


class Cuda:
    def __init__(self) -> None:
        self.site: InitSite | None = None
        self._shell = None
        self._cells = None  # nbddp.ipy.cells, given at install (hw imports nothing of ipy)
        self._wrapped = False
        self._probed_at: int | None = None  # execution count of the last clean probe
        self.watch = driverwatch.Watcher()

    # -- kernel side ------------------------------------------------------------------------------
    def install(self, shell=None, cells=None) -> None:
        """``cells``: how the shell numbers its cells (``nbddp.ipy.cells``: the running one, file names)."""
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        # CUDA numbers GPUs fastest-first unless told otherwise; NVML (and nvidia-smi) by PCI bus.
        # Same order for both, so the dashboard's cuda:N is the rank's cuda:N.
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        self._shell, self._cells = shell, cells
        self._wrap_lazy_init()
        if shell is not None:
            self.uninstall(shell)  # %reload_ext: registered once
            shell.events.register("post_run_cell", self._after_cell)
        self.watch.start(shell)

    def uninstall(self, shell) -> None:
        try:
            shell.events.unregister("post_run_cell", self._after_cell)
        except ValueError:
            pass
        self.watch.stop(shell)

    def _after_cell(self, result=None) -> None:
        self._wrap_lazy_init()  # torch may have been imported by this cell
        count = self._cells.running(self._shell)
        src = getattr(getattr(result, "info", None), "raw_cell", "") or ""
        if self.site is None and self._torch_initialised():
            first = next((ln.strip() for ln in src.splitlines() if ln.strip()), "")
            self.site = InitSite(f"In [{count}]", None, first)
        self.watch.after_cell(f"In [{count}]", src)

    def _wrap_lazy_init(self) -> None:
        tc = sys.modules.get("torch.cuda")
        if self._wrapped or tc is None or not hasattr(tc, "_lazy_init"):
            return
        original = tc._lazy_init
        guard = self

        def _lazy_init():
            if guard.site is None and not getattr(tc, "_initialized", False):
                guard.site = guard._site_from_stack(traceback.extract_stack()[:-1])
            return original()

        tc._lazy_init = _lazy_init
        for name in NVML_CALLS:  # torch's NVML-based is_available opens the driver's device files
            if callable(call := getattr(tc, name, None)):
                setattr(tc, name, _not_cuda(call))
        self._wrapped = True

    def _site_from_stack(self, frames) -> InitSite:
        fmap = self._cells.numbers(self._shell) if self._cells is not None else {}
        library = _library_of(frames, fmap)
        for fr in reversed(frames):
            if fr.filename in fmap:
                return InitSite(f"In [{fmap[fr.filename]}]", fr.lineno, (fr.line or "").strip(), library)
        for fr in reversed(frames):  # not from a cell: the innermost frame outside torch
            if "/torch/" not in fr.filename:
                return InitSite(fr.filename, fr.lineno, (fr.line or "").strip())
        fr = frames[-1]
        return InitSite(fr.filename, fr.lineno, (fr.line or "").strip())

    @staticmethod
    def _torch_initialised() -> bool:
        tc = sys.modules.get("torch.cuda")
        return bool(tc is not None and getattr(tc, "_initialized", False))

    def refusal(self) -> CudaInitialisedError | None:
        """Why a forked GPU rank could not use CUDA, as the error to raise; None when forking is safe.

        Never creates a context and never loads the driver library in the kernel."""
        w = self.watch
        if self._torch_initialised() and self.site and self.site.line is None and w.initialised is not None:
            return _refusal_for(w.initialised, w)  # torch was imported and initialised in one cell: the
            # watcher knows the module, the lazy-init wrapper (installed after that cell) could not
        if self._torch_initialised():
            site = self.site
            imp = site.code if site and site.code.startswith(("import ", "from ")) else None
            return _refusal(str(site) if site else None, site.module if site else None, imp, torch=True)
        if w.library is None and driverwatch.driver_mapped() is None:
            return None  # the driver was never loaded here: nothing can have initialised it
        count = getattr(self._shell, "execution_count", None)
        if count is not None and count == self._probed_at:
            return None
        if self._forked_child_can_init():
            self._probed_at = count
            w.no_context()
            return None
        sighting = w.initialised or w.loaded  # where a device file opened, else where the driver was loaded
        return _refusal_for(sighting, w) if sighting else _refusal(None, None, None)

    def culprits(self) -> set[str]:
        """The packages seen initialising CUDA in the kernel (a forkserver never imports them ahead). Never torch:
        its CUDA wheels map the driver as they are imported, the forkserver has torch already, and importing its
        modules initialises no device (a forkserver without them imported ``torch._dynamo`` again in every rank:
        4 s a cell on an H200). A module whose import did would end the forkserver, which starts again without it."""
        found = {self.site.module if self.site else None}
        for s in (self.watch.initialised, self.watch.loaded):  # (a library that only loaded it is left too)
            if s is not None:
                found |= {s.module, *s.suspects}
        return {m.partition(".")[0] for m in found if m} - {"torch"}

    @staticmethod
    def _forked_child_can_init() -> bool:
        """Fork a throwaway child and call ``cuInit`` there: a context in the parent makes it fail.

        Only the child opens the driver library (called only once the kernel has it mapped)."""
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the throwaway child
            code = 2  # the throwaway child never returns: any other failure is its exit code
            try:
                code = 0 if ctypes.CDLL(driverwatch.DRIVER_SONAME).cuInit(0) == 0 else 1
            except OSError:
                code = 0  # no driver after all: nothing to poison
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0

    # -- rank side --------------------------------------------------------------------------------
    def set_device(self, index: int):
        """In a rank: its GPU. In a rank of the forkserver NVML does not start (seen on an H200, cause not known):
        torch then counts the GPUs with the CUDA runtime, as it would anyway, but warned "Can't initialize NVML"
        in every such rank's first cell; that warning is silenced here."""
        import warnings

        import torch

        warnings.filterwarnings("ignore", message="Can't initialize NVML", category=UserWarning)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def built(self) -> bool:
        """torch was built with CUDA (a CPU wheel cannot drive a GPU even where NVML sees one)."""
        try:
            import torch

            return torch.version.cuda is not None
        except ImportError:
            return False


def ipc_share(tensor):
    """A reduction of the kernel's GPU tensor for a rank forked from the forkserver (never a fork of a kernel
    holding CUDA: CUDA IPC needs a process of its own): torch's CUDA IPC handle, opened in the rank, which
    copies it at once, device to device, so a rank's write stays its own. The rank on the tensor's GPU
    copies within it; a rank on another GPU reads it from there, at the cost of one more CUDA context on that
    GPU in the rank (300-500 MiB, said by the cell). None where IPC is not there (the tensor is then pickled
    as its CPU copy)."""
    try:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(tensor)
    except Exception:  # noqa: BLE001 - WSL2, Jetson, a device without IPC: pickled as its CPU copy
        return None
    return opened_on_rank, (rebuild, args, tensor.device.index, dict(tensor.__dict__) or None)


def opened_on_rank(rebuild, args, source: int, attributes: dict | None = None):
    """In the rank: the kernel's GPU tensor, opened by its IPC handle and copied onto this rank's GPU, with the
    attributes it carried (``attributes``: its ``__dict__``, as torch's own pickling keeps it)."""
    import torch

    shared = rebuild(*args)
    mine = torch.device("cuda", torch.cuda.current_device())
    with torch.no_grad():  # a leaf as it was (a parameter stays one: an optimizer can take it)
        own = shared.detach().clone() if mine.index == source else shared.detach().to(mine)
    if isinstance(shared, torch.nn.Parameter):
        own = torch.nn.Parameter(own, requires_grad=shared.requires_grad)
    else:
        own.requires_grad_(shared.requires_grad)
    own.__dict__.update(attributes or {})
    return own


def held_here() -> bool:
    """This process holds a CUDA context, torch's or anyone's (a forked child of it could not use a GPU).
    For a process that is no kernel (the forkserver): creates no context, loads no driver."""
    if Cuda._torch_initialised():
        return True
    return driverwatch.driver_mapped() is not None and not Cuda._forked_child_can_init()


NVML_CALLS = ("_raw_device_count_nvml", "_raw_device_uuid_nvml")  # torch.cuda's, under PYTORCH_NVML_BASED_CUDA_CHECK


def _not_cuda(call):
    def wrapped(*args, **kwargs):
        with driverwatch.not_cuda():
            return call(*args, **kwargs)

    return functools.wraps(call)(wrapped)


def _library_of(frames, cell_files) -> str | None:
    """The innermost library (not torch, not a cell) on the stack that led to torch's CUDA init."""
    for fr in reversed(frames):
        if fr.filename in cell_files:
            return None  # the cell called torch.cuda itself
        if "/torch/" in fr.filename or "/nbddp/" in fr.filename or fr.filename.startswith("<"):
            continue
        mod = _module_for_file(fr.filename)
        if mod:
            return mod
    return None


def _module_for_file(path: str) -> str | None:
    for name, mod in list(sys.modules.items()):
        if getattr(mod, "__file__", None) == path:
            return name
    return None


RESTART = ("restart the kernel and run %load_ext nbddp before {what}\n"
           "       (nbddp sets PYTORCH_NVML_BASED_CUDA_CHECK=1: a library that only asks torch.cuda.is_available()\n"
           "       then creates no context),")
SPAWN = ("or drop --start-method fork: nbddp's forkserver then starts the ranks (no restart; the cell's globals "
         "are sent,\n       tensors through shared memory).")


def _refusal_for(s: driverwatch.Sighting, w: driverwatch.Watcher) -> CudaInitialisedError:
    if s.cell.startswith("before"):
        what = "initialised" if w.initialised is not None else "loaded"
        return _refusal(None, None, None, detail=f"The CUDA driver ({w.library}) was {what} {s.cell}.")
    line = s.import_line or s.code
    where = f"{s.cell}: {line}" if line else s.cell
    return _refusal(f"{where} ({s.culprit()})", s.module or (s.suspects[0] if len(s.suspects) == 1 else None),
                    s.import_line)


def _refusal(site: str | None, module: str | None, import_line: str | None, *, torch: bool = False,
             detail: str | None = None) -> CudaInitialisedError:
    if site:
        head = f"CUDA was initialised in this kernel by {site}."
    else:
        head = (detail + "\n" if detail else "") + (
            "CUDA is already initialised in this kernel (by a library, or torch.cuda calls that create a context).")
    package = module.split(".")[0] if module else None
    if package:
        fixes = [f"move `{import_line or 'import ' + package}` into the %%ddp cell (each rank imports it after "
                 "the fork),",
                 "or " + RESTART.format(what=f"import {package}")]
    elif torch:
        fixes = ["restart the kernel and move every .cuda()/.to('cuda') into the %%ddp cell "
                 "(build datasets on the CPU in the notebook),"]
    else:
        fixes = ["import CUDA libraries inside the %%ddp cell (restart the kernel first),",
                 "or " + RESTART.format(what="importing them")]
    return CudaInitialisedError(
        f"{head}\nA forked rank cannot use a GPU once the kernel holds a CUDA context, so nothing was launched.\n"
        "Fix: " + "\n     ".join(fixes + [SPAWN])
    )


_backend = Cuda()


def backend():
    return _backend


def use(stand_in) -> None:
    """Replace the CUDA seam (tests). ``stand_in`` provides the public methods of ``Cuda``."""
    global _backend
    _backend = stand_in
