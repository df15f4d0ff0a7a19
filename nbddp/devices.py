"""From what the user asked (--devices, --accelerator, --backend) to a concrete plan, or a clear error.

Device strings follow PyTorch Lightning's table, so users need not learn a new one:
``3``/``"3"`` -> three devices 0,1,2; ``"1,3"``/``[1, 3]`` -> devices 1 and 3; ``-1`` -> all;
``"auto"`` -> all GPUs, or one CPU rank. Duplicates, zero and negatives other than -1 are refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import cuda, nvml
from .errors import UsageError

ACCELERATORS = ("auto", "cuda", "cpu")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class Plan:
    accelerator: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    device_ids: tuple[int | None, ...]  # one per rank: a GPU index, or None for a CPU rank

    @property
    def world_size(self) -> int:
        return len(self.device_ids)


def parse_devices(spec) -> list[int] | int | str:
    """Normalise a device spec: "auto", -1, a count (int), or an explicit index list."""
    if isinstance(spec, (list, tuple)):
        ids = [_int(x, spec) for x in spec]
        return _check_list(ids, spec)
    if isinstance(spec, int) and not isinstance(spec, bool):
        return _check_count(spec, spec)
    text = str(spec).strip()
    if text.lower() == "auto":
        return "auto"
    if "," in text:
        ids = [_int(p, spec) for p in text.split(",") if p.strip()]
        return _check_list(ids, spec)
    return _check_count(_int(text, spec), spec)


def _int(x, spec) -> int:
    try:
        return int(str(x).strip())
    except ValueError:
        raise UsageError(
            f"--devices {spec!r} is not a device spec.\n"
            "Use a count (2), GPU indices (0,2), -1 for all, or auto."
        ) from None


def _check_count(n: int, spec):
    if n == -1:
        return -1
    if n <= 0:
        raise UsageError(f"--devices {spec!r}: need at least one device (a count >= 1, or -1 for all).")
    return n


def _check_list(ids: list[int], spec) -> list[int]:
    if not ids:
        raise UsageError(f"--devices {spec!r} names no device.")
    if any(i < 0 for i in ids):
        raise UsageError(f"--devices {spec!r}: device indices cannot be negative.")
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise UsageError(f"--devices {spec!r} lists device {', '.join(map(str, dups))} more than once.")
    return ids


def plan(devices="auto", accelerator: str = "auto", backend: str = "auto") -> Plan:
    """Resolve the request against what NVML sees; raise UsageError before anything is launched."""
    if accelerator not in ACCELERATORS:
        raise UsageError(f"--accelerator {accelerator!r}: choose one of {', '.join(ACCELERATORS)}.")
    if backend not in BACKENDS:
        raise UsageError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}.")
    spec = parse_devices(devices)
    gpus = nvml.backend().count()
    if accelerator == "auto":
        accelerator = "cuda" if gpus and cuda.backend().built() else "cpu"
    if accelerator == "cuda":
        ids = _gpu_ids(spec, gpus)
        backend = "nccl" if backend == "auto" else backend
    else:
        if backend == "nccl":
            raise UsageError(
                "--backend nccl needs GPUs, but these ranks run on CPU.\n"
                "Use --backend gloo (or auto), or --accelerator cuda on a machine with GPUs."
            )
        ids = [None] * _cpu_count(spec)
        backend = "gloo"
    return Plan(accelerator, backend, tuple(ids))


def _gpu_ids(spec, gpus: int) -> list[int]:
    if gpus == 0:
        why = "" if cuda.backend().built() else " (and this torch is a CPU build)"
        raise UsageError(
            f"--accelerator cuda, but NVML sees no GPU on this machine{why}.\n"
            "Use --accelerator cpu (gloo ranks), or run on a machine with NVIDIA GPUs and nvidia-ml-py installed."
        )
    if not cuda.backend().built():
        raise UsageError(
            f"NVML sees {gpus} GPU(s) but this torch ({_torch_version()}) has no CUDA support.\n"
            "Install a CUDA build of torch, or use --accelerator cpu."
        )
    if spec in ("auto", -1):
        return list(range(gpus))
    ids = list(range(spec)) if isinstance(spec, int) else spec
    missing = [i for i in ids if i >= gpus]
    if missing:
        names = nvml.backend().names()
        listing = "\n".join(f"  cuda:{i}  {n}" for i, n in enumerate(names)) or f"  {gpus} GPU(s)"
        raise UsageError(
            f"--devices asks for GPU {', '.join(map(str, missing))}, but this machine has {gpus}:\n{listing}\n"
            f"Use --devices {gpus} (or -1) for all of them."
        )
    return ids


def _cpu_count(spec) -> int:
    if spec == "auto":
        return 1
    if spec == -1:
        return os.cpu_count() or 1
    if isinstance(spec, list):
        raise UsageError(
            f"--devices {','.join(map(str, spec))}: CPU ranks are counted, not indexed.\n"
            f"Use --devices {len(spec)} for {len(spec)} CPU ranks."
        )
    return spec


def _torch_version() -> str:
    try:
        import torch

        return f"torch {torch.__version__}"
    except ImportError:
        return "torch not installed"
