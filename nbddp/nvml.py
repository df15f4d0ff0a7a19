"""The NVML seam: counting and sampling GPUs without ever initialising CUDA in the kernel.

Everything nbddp knows about GPUs in the parent comes through ``backend()``. Tests replace it with
``use(stand_in)``; nothing else in nbddp imports pynvml.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    util_percent: float | None
    mem_used: int | None
    mem_total: int | None
    power_w: float | None
    temp_c: float | None


class Nvml:
    """nvidia-ml-py (``pynvml``), if installed and a driver answers; otherwise no GPUs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._handles: list = []

    def _init(self) -> bool:
        with self._lock:
            if self._ok is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    count = pynvml.nvmlDeviceGetCount()
                    self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible(count)]
                    self._ok = True
                except Exception:  # no pynvml, no driver, no GPU: all mean "no GPUs here"
                    self._ok = False
            return self._ok

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
    try:
        return fn()
    except Exception:
        return None


_backend = Nvml()


def backend():
    return _backend


def use(stand_in) -> None:
    """Replace the NVML backend (tests and exotic platforms). ``stand_in`` has count/names/sample."""
    global _backend
    _backend = stand_in
