"""From what the user asked (--devices, --accelerator, --backend) to a concrete plan, or a clear error.

Device strings follow PyTorch Lightning's table, so users need not learn a new one:
``3``/``"3"`` -> three devices 0,1,2; ``"1,3"``/``[1, 3]`` -> devices 1 and 3; ``-1`` -> all;
``"auto"`` -> all *free* GPUs, or one CPU rank. Duplicates, zero and negatives other than -1 are refused.

On GPUs a count or ``auto`` picks free GPUs only (gpufree.py decides from NVML: no other compute process,
compute mode allows a context, memory use under the threshold); ``-1`` and explicit indices are used as
given. Whatever was skipped, or is busy but used anyway, is said in ``Plan.notes`` (the launcher prints them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import UsageError
from ..hw import cuda, gpufree, nvml

ACCELERATORS = ("auto", "cuda", "cpu")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class Plan:
    accelerator: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    device_ids: tuple[int | None, ...]  # one per rank: a GPU index, or None for a CPU rank
    notes: tuple[str, ...] = field(default=(), compare=False)  # for the user: GPUs skipped or busy, and why
    start_method: str = "fork"  # how its ranks start: --start-method, or the forkserver for a kernel holding CUDA

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
    notes: list[str] = []
    if accelerator == "cuda":
        ids, notes = _gpu_ids(spec, gpus)
        backend = "nccl" if backend == "auto" else backend
    else:
        if backend == "nccl":
            raise UsageError(
                "--backend nccl needs GPUs, but these ranks run on CPU.\n"
                "Use --backend gloo (or auto), or --accelerator cuda on a machine with GPUs."
            )
        ids = [None] * _cpu_count(spec)
        backend = "gloo"
    return Plan(accelerator, backend, tuple(ids), tuple(notes))


def _gpu_ids(spec, gpus: int) -> tuple[list[int], list[str]]:
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
    if isinstance(spec, list) or spec not in ("auto", -1):
        _check_exist(spec if isinstance(spec, list) else list(range(spec)), gpus)
    found = gpufree.survey(gpus)
    if spec == -1 or isinstance(spec, list):  # asked for by name (or all): used as given, busy or not
        ids = list(range(gpus)) if spec == -1 else spec
        notes = [f"nbddp: warning: cuda:{i} is busy: {found.busy[i]}; using it as asked (--devices {_spec(spec)})."
                 for i in ids if found.busy[i]]
    else:
        ids, notes = _pick_free(spec, gpus, found)
    mig = found.mig_note(ids)
    return ids, notes + ([mig] if mig else [])


def _pick_free(spec, gpus: int, found: gpufree.GpuSurvey) -> tuple[list[int], list[str]]:
    free = found.free()
    want = len(free) if spec == "auto" else spec
    if not free or len(free) < want:
        listing = "\n".join(f"  cuda:{i}  {why or 'free'}" for i, why in found.busy.items())
        asked = "--devices auto found no free GPU" if spec == "auto" else \
            f"--devices {spec} asks for {spec} free GPUs, but {len(free)} of {gpus} are free"
        fixes = [f"--devices {len(free)} (the free ones)"] if free else []
        named = _spec(list(range(gpus if spec == "auto" else min(spec, gpus))))
        fixes.append(f"--devices {named} (GPUs named by index are used even if busy)")
        raise UsageError(f"{asked}:\n{listing}\nUse " + ", or ".join(fixes) + ", or wait until they are free.")
    ids = free[:want]
    skipped = [i for i in range(gpus) if found.busy[i] and (spec == "auto" or i < ids[-1])]
    if not skipped:
        return ids, []
    using = ", ".join(f"cuda:{i}" for i in ids)
    lines = [f"nbddp: --devices {spec} uses the free GPU{'s' if len(ids) > 1 else ''} {using}; skipped:"]
    lines += [f"  cuda:{i}  {found.busy[i]}" for i in skipped]
    return ids, ["\n".join(lines)]


def _spec(spec) -> str:
    """As the user would type it: a one-GPU list needs its comma ("0," is GPU 0; "0" would be a count)."""
    if not isinstance(spec, list):
        return str(spec)
    return ",".join(map(str, spec)) + ("," if len(spec) == 1 else "")


def _check_exist(ids: list[int], gpus: int) -> None:
    missing = [i for i in ids if i >= gpus]
    if missing:
        names = nvml.backend().names()
        listing = "\n".join(f"  cuda:{i}  {n}" for i, n in enumerate(names)) or f"  {gpus} GPU(s)"
        raise UsageError(
            f"--devices asks for GPU {', '.join(map(str, missing))}, but this machine has {gpus}:\n{listing}\n"
            f"Use --devices {gpus} (or -1) for all of them."
        )


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
