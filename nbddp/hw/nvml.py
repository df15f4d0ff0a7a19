"""The NVML seam: counting and sampling GPUs without ever initialising CUDA in the kernel.

Everything nbddp knows about GPUs in the parent comes through ``backend()``. Tests replace it with
``use(stand_in)``; nothing else in nbddp imports pynvml.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from . import driverwatch


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    util_percent: float | None
    mem_used: int | None
    mem_total: int | None
    power_w: float | None
    temp_c: float | None


@dataclass(frozen=True)
class GpuUse:
    """Who is using a GPU now: what the free-GPU pick (gpufree.py) decides on."""

    index: int
    name: str
    mem_used: int | None  # bytes; None where NVML would not say
    mem_total: int | None
    processes: tuple[tuple[int, int | None], ...] | None  # compute processes (pid, bytes); None: unknown
    compute_mode: str = "default"  # "default", "exclusive_process", "exclusive_thread", "prohibited", "unknown"
    mig: bool = False  # MIG mode on: figures are summed over its MIG instances


COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}  # nvmlComputeMode_t


class Nvml:
    """nvidia-ml-py (``pynvml``), if installed and a driver answers; otherwise no GPUs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._handles: list = []

    def _init(self) -> bool:
        with self._lock:
            if self._ok is None:
                self._ok = self._found()
            return self._ok

    def _found(self) -> bool:
        try:
            import pynvml
        except ImportError:  # no pynvml: no GPUs here
            return False
        try:
            with driverwatch.not_cuda():  # NVML opens the driver's device files, as cuInit does
                pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible(count)]
        except pynvml.NVMLError:  # no driver, no GPU (every error NVML answers is one): no GPUs here
            return False
        return True

    def count(self) -> int:
        return len(self._handles) if self._init() else 0

    def names(self) -> list[str]:
        if not self._init():
            return []
        import pynvml

        return [_str(pynvml.nvmlDeviceGetName(h)) for h in self._handles]

    def sample(self, indices: list[int]) -> list[GpuSample]:
        if not self._init():
            return []
        import pynvml

        return [_sample(pynvml, i, self._handles[i]) for i in indices]

    def usage(self) -> list[GpuUse]:
        """Memory, compute processes, compute mode and MIG mode of every visible GPU."""
        if not self._init():
            return []
        import pynvml

        return [_usage(pynvml, i, h) for i, h in enumerate(self._handles)]


def _usage(pynvml, index: int, handle) -> GpuUse:
    mig = _try(lambda: pynvml.nvmlDeviceGetMigMode(handle)[0]) == 1  # (current, pending); 1 = enabled
    # In MIG mode the parent answers only to privileged callers: ask each MIG instance and sum.
    parts = _mig_instances(pynvml, handle) if mig else [handle]
    mems = [_try(lambda h=h: pynvml.nvmlDeviceGetMemoryInfo(h)) for h in parts]
    procs = [_try(lambda h=h: pynvml.nvmlDeviceGetComputeRunningProcesses(h)) for h in parts]
    total_mem = _try(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    known = parts and all(m is not None for m in mems)
    return GpuUse(
        index=index,
        name=_str(pynvml.nvmlDeviceGetName(handle)),
        mem_used=sum(int(m.used) for m in mems) if known else None,
        mem_total=int(total_mem.total) if total_mem is not None else (
            sum(int(m.total) for m in mems) if known else None),
        processes=tuple((int(p.pid), _bytes(getattr(p, "usedGpuMemory", None))) for ps in procs for p in ps)
        if parts and all(ps is not None for ps in procs) else None,
        compute_mode=COMPUTE_MODES.get(_try(lambda: pynvml.nvmlDeviceGetComputeMode(handle)), "unknown"),
        mig=mig,
    )


def _mig_instances(pynvml, handle) -> list:
    found = []
    for i in range(_try(lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0):
        h = _try(lambda i=i: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
        if h is not None:
            found.append(h)
    return found


def _bytes(v) -> int | None:
    return int(v) if isinstance(v, int) and v >= 0 else None  # pynvml gives None when NVML cannot tell


def _sample(pynvml, index: int, handle) -> GpuSample:
    mem = _try(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    return GpuSample(
        index=index,
        name=_str(pynvml.nvmlDeviceGetName(handle)),
        util_percent=_try(lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)),
        mem_used=int(mem.used) if mem is not None else None,
        mem_total=int(mem.total) if mem is not None else None,
        power_w=_try(lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),  # milliwatts
        temp_c=_try(lambda: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))),
    )


def _visible(count: int) -> list[int]:
    """NVML indexes every GPU; honour CUDA_VISIBLE_DEVICES when it lists plain indices."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    picked = []
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit():  # UUIDs/MIG names or "-1": stop like CUDA does at the first invalid entry
            break
        if int(part) < count:
            picked.append(int(part))
    return picked


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _try(fn):
    import pynvml  # (imported already: a query comes after Nvml._init found it)

    try:
        return fn()
    except (pynvml.NVMLError, AttributeError):  # NVML's errors (its many types are all NVMLError), or bindings
        return None  # older than the call: a query that fails has no answer


_backend = Nvml()


def backend():
    return _backend


def use(stand_in) -> None:
    """Replace the NVML backend (tests and exotic platforms). ``stand_in`` has count/names/sample, and
    ``usage`` for free-GPU picking (without it every GPU counts as free)."""
    global _backend
    _backend = stand_in
