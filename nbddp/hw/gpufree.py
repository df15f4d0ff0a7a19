"""Which GPUs are free, and why the others are not: decided from NVML's figures alone.

Lightning's ``find_usable_cuda_devices`` tries a tensor on each GPU, which creates a CUDA context in the
caller and rules out forking afterwards. nbddp asks NVML instead (``nvml.backend().usage()``): a GPU is
busy when another process computes on it, when its compute mode forbids a new context, or when more than
``BUSY_MEMORY_FRACTION`` of its memory is in use (processes NVML cannot show, e.g. from other containers).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..units import size
from . import nvml

BUSY_MEMORY_FRACTION = 0.10  # the one threshold: more than this share of a GPU's memory in use = busy


def why_busy(use: nvml.GpuUse, own_pids: set[int] = frozenset()) -> str | None:
    """One line saying why ``use`` is not free, or None when it is."""
    if use.compute_mode == "prohibited":
        return "its compute mode is Prohibited (no process may create a context)"
    others = [(pid, b) for pid, b in (use.processes or ()) if pid not in own_pids]
    if others:
        shown = ", ".join(_process(pid, b) for pid, b in others[:3]) + (", …" if len(others) > 3 else "")
        line = f"{len(others)} other compute process{'es' if len(others) > 1 else ''} on it ({shown})"
        if use.compute_mode in ("exclusive_process", "exclusive_thread"):
            line += "; it is in exclusive-process mode, so a rank could not create a context there"
        return line
    if use.mem_used is not None and use.mem_total and use.mem_used > BUSY_MEMORY_FRACTION * use.mem_total:
        return (f"{size(use.mem_used)} of its {size(use.mem_total)} memory is in use "
                f"(over {BUSY_MEMORY_FRACTION:.0%}, by processes NVML does not show here)")
    return None


@dataclass(frozen=True)
class GpuSurvey:
    busy: dict  # GPU index -> why it is busy, or None when free
    mig: tuple[int, ...] = ()  # GPUs in MIG mode

    def free(self) -> list[int]:
        return [i for i, why in self.busy.items() if why is None]

    def mig_note(self, ids) -> str | None:
        mig = [i for i in ids if i in self.mig]
        if not mig:
            return None
        return (f"nbddp: cuda:{', cuda:'.join(map(str, mig))} is in MIG mode: a rank there sees one MIG instance "
                "(choose it with CUDA_VISIBLE_DEVICES=MIG-<uuid>), and NCCL does not run across MIG instances.")


def survey(gpus: int) -> GpuSurvey:
    """Why each visible GPU is busy (None: free). A seam without ``usage`` (or NVML answering nothing for
    a GPU) counts the GPU as free."""
    usage = getattr(nvml.backend(), "usage", None)
    found = {u.index: u for u in (usage() if usage else [])}
    own = _own_pids()
    return GpuSurvey({i: why_busy(found[i], own) if i in found else None for i in range(gpus)},
                  tuple(i for i, u in found.items() if u.mig))


def _own_pids() -> set[int]:
    pids = {os.getpid()}
    try:
        import psutil
    except ImportError:  # psutil missing: the kernel's own pid is what matters
        return pids
    try:
        pids.update(p.pid for p in psutil.Process().children(recursive=True))
    except (psutil.Error, OSError):  # a child gone: the kernel's own pid is what matters
        pass
    return pids


def _process(pid: int, used: int | None) -> str:
    who = _user(pid)
    parts = [p for p in (who, size(used) if used is not None else None) if p]
    return f"pid {pid}" + (f" {' '.join(parts)}" if parts else "")


def _user(pid: int) -> str | None:
    try:
        import psutil
    except ImportError:  # psutil missing: no name
        return None
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, OSError):  # another container's pid, or no permission
        return None

