"""What several test files use, defined once: NVML replaced at its seam (also imported inside a test kernel,
so this module imports nothing but nbddp's NVML seam, and that only when a sample is taken) and a pool's
rank pids. The kernels themselves are in kernel.py, the shared fixtures in conftest.py."""
from __future__ import annotations

TESTS = __file__.rpartition("/")[0]  # for a test kernel's sys.path: ``from helpers import FakeNvml`` there


class FakeNvml:
    """NVML at its seam (``nvml.use``, or ``nvml._backend`` monkeypatched): ``n`` GPUs named ``name``
    (``{i}``: the index). ``readings``: each ``sample`` a fresh reading (``calls`` counts them; utilisation
    10 % and memory 1 GiB higher each time), else none. ``uses``: what ``usage`` answers for free-GPU
    picking (none: every GPU is free)."""

    def __init__(self, n: int = 2, name: str = "Fake GPU {i}", readings: bool = False, uses=None):
        self.n, self.name, self.readings, self.uses = n, name, readings, list(uses or [])
        self.calls = 0

    def count(self):
        return self.n

    def names(self):
        return [self.name.format(i=i) for i in range(self.n)]

    def sample(self, indices):
        if not self.readings:
            return []
        from nbddp.hw import nvml

        self.calls += 1
        return [nvml.GpuSample(i, self.name.format(i=i), util_percent=10.0 * self.calls + i,
                               mem_used=(20 + self.calls) * 2**30, mem_total=80 * 2**30, power_w=300.0 + i,
                               temp_c=60.0) for i in indices]

    def usage(self):
        return self.uses


def fake_nvml_in_kernel(n: int = 2, name: str = "Fake H100") -> str:
    """A test kernel's code that replaces its NVML with a ``FakeNvml`` (``FakeNvml`` bound in its namespace)."""
    return (f"import sys\nsys.path.insert(0, {TESTS!r})\nimport nbddp, nbddp.hw.cuda, nbddp.hw.nvml\n"
            f"from helpers import FakeNvml\nnbddp.hw.nvml.use(FakeNvml({n}, {name!r}))\n")


FORKSERVER = "nbddp-forksrv"  # the forkserver's process name (rank/forkloop.py's NAME): it lives with the kernel


def left_behind(k) -> list:
    """The kernel's descendants but its forkserver (which lives as long as the kernel): ranks left running."""
    return [p for p in k.process().children(recursive=True) if _name(p) != FORKSERVER]


def _name(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return ""


POOL = "get_ipython().magics_manager.registry['DDPMagics'].pool"  # the running pool, as a test kernel names it


def pool_pids(k) -> list[int]:
    """The pids of the running pool's ranks in kernel ``k``, in rank order (rank ``r``'s at index ``r``: pids are
    no order, a long run wraps them), as the pool records them, each checked to be a process of the kernel's
    tree: its direct child, or its forkserver's (each rank's guardian ``sh`` is the rank's own child)."""
    found = set()
    for p in k.process().children():
        found |= {c.pid for c in p.children()} if _name(p) == FORKSERVER else {p.pid}
    pids = k.value(f"[p.pid for p in sorted({POOL}.gang.sup.live(), key=lambda p: p.rank)]")
    assert set(pids) <= found, f"the pool's ranks {pids} are the kernel's processes {sorted(found)}"
    return pids


def pool_in(k, before: str = ""):
    """The body of a ``pool`` fixture (conftest.py's, or a test file's own with ``before``): ``before`` run in
    the notebook first (the ranks are forked with it), a 2-rank pool started, ``k`` yielded, the pool
    stopped after the test."""
    if before:
        k.ok(before)
    res = k.ok("%ddp start --devices 2")
    assert "pool of 2 rank(s) on cpu/gloo ready" in res.stdout
    yield k
    k.ok("%ddp stop")
