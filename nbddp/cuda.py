"""The CUDA seam: the only module that talks to CUDA, in the kernel or in a rank.

In the kernel nbddp must never initialise CUDA (a forked child of a process with a CUDA context cannot
use the GPU). So this module only *watches*: it sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (so
``torch.cuda.is_available()`` asks NVML instead of creating a context), wraps torch's lazy CUDA init to
record which cell and line created the context, and, before a GPU fork, asks a throwaway forked child
whether it can still initialise the driver (this catches libraries that call ``cuInit`` behind
torch's back). Tests swap the whole seam with ``use(stand_in)``.
"""
from __future__ import annotations

import ctypes
import os
import sys
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class InitSite:
    cell: str  # "In [5]" or a file name
    line: int | None
    code: str

    def __str__(self) -> str:
        where = f"{self.cell}, line {self.line}" if self.line else self.cell
        return f"{where}: {self.code}" if self.code else where


class Cuda:
    def __init__(self) -> None:
        self.site: InitSite | None = None
        self._shell = None
        self._wrapped = False
        self._probed_at: int | None = None  # execution count of the last clean probe

    # -- kernel side ------------------------------------------------------------------------------
    def install(self, shell=None) -> None:
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        # CUDA numbers GPUs fastest-first unless told otherwise; NVML (and nvidia-smi) by PCI bus.
        # Same order for both, so the dashboard's cuda:N is the rank's cuda:N.
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        self._shell = shell
        self._wrap_lazy_init()
        if shell is not None:
            self.uninstall(shell)  # %reload_ext: registered once
            shell.events.register("post_run_cell", self._after_cell)

    def uninstall(self, shell) -> None:
        try:
            shell.events.unregister("post_run_cell", self._after_cell)
        except ValueError:
            pass

    def _after_cell(self, result=None) -> None:
        self._wrap_lazy_init()  # torch may have been imported by this cell
        if self.site is None and self._torch_initialised():
            count = getattr(self._shell, "execution_count", 1) - 1
            src = getattr(getattr(result, "info", None), "raw_cell", "") or ""
            first = next((ln.strip() for ln in src.splitlines() if ln.strip()), "")
            self.site = InitSite(f"In [{count}]", None, first)

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
        self._wrapped = True

    def _site_from_stack(self, frames) -> InitSite:
        fmap = getattr(getattr(self._shell, "compile", None), "_filename_map", {}) or {}
        for fr in reversed(frames):
            if fr.filename in fmap:
                return InitSite(f"In [{fmap[fr.filename]}]", fr.lineno, (fr.line or "").strip())
        for fr in reversed(frames):  # not from a cell: the innermost frame outside torch
            if "/torch/" not in fr.filename:
                return InitSite(fr.filename, fr.lineno, (fr.line or "").strip())
        fr = frames[-1]
        return InitSite(fr.filename, fr.lineno, (fr.line or "").strip())

    @staticmethod
    def _torch_initialised() -> bool:
        tc = sys.modules.get("torch.cuda")
        return bool(tc is not None and getattr(tc, "_initialized", False))

    def initialised_in_kernel(self) -> bool:
        """True when the kernel holds a CUDA context (torch's or anyone's). Never creates one."""
        if self._torch_initialised():
            return True
        count = getattr(self._shell, "execution_count", None)
        if count is not None and count == self._probed_at:
            return False
        if self._forked_child_can_init():
            self._probed_at = count
            return False
        return True

    @staticmethod
    def _forked_child_can_init() -> bool:
        """Fork a throwaway child and call ``cuInit`` there: a context in the parent makes it fail."""
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return True  # no driver: nothing to poison
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the throwaway child
            try:
                rc = ctypes.CDLL("libcuda.so.1").cuInit(0)
            except BaseException:
                os._exit(2)
            os._exit(0 if rc == 0 else 1)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0

    # -- rank side --------------------------------------------------------------------------------
    def set_device(self, index: int):
        import torch

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


_backend = Cuda()


def backend():
    return _backend


def use(stand_in) -> None:
    """Replace the CUDA seam (tests). ``stand_in`` provides the public methods of ``Cuda``."""
    global _backend
    _backend = stand_in
