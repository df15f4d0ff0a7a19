"""Sampling what ranks use, about once a second: CPU and memory per rank (psutil), GPUs (NVML seam).

Memory per CPU rank is shown three ways so copy-on-write is visible: RSS (all resident pages), USS
(pages only this rank has: what it copied or allocated) and shared = RSS - USS (pages still shared
with the notebook and the other ranks).
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil

from ..hw import nvml


@dataclass
class RankSample:
    cpu_percent: float = 0.0
    rss: int = 0
    uss: int = 0
    peak_rss: int = 0
    peak_uss: int = 0

    @property
    def shared(self) -> int:
        return max(0, self.rss - self.uss)


@dataclass
class GpuHistory:
    last: nvml.GpuSample | None = None
    peak_mem: int = 0


class Monitor:
    def __init__(self, gpu_indices: list[int]):
        self.gpu_indices = gpu_indices
        self.ranks: dict[int, RankSample] = {}
        self.gpus: dict[int, GpuHistory] = {i: GpuHistory() for i in gpu_indices}
        self._procs: dict[int, psutil.Process] = {}
        self._pids: dict[int, int] = {}
        self.lost: set[int] = set()  # ranks whose process was gone at a sample

    def watch(self, rank: int, pid: int) -> None:
        self._pids[rank] = pid  # psutil handles are made at the first sample: a short run never pays
        self.ranks[rank] = RankSample()

    def forget(self, rank: int) -> None:
        self._procs.pop(rank, None)
        self._pids.pop(rank, None)

    def sample(self, uss: bool = True) -> None:
        """CPU and RSS of every rank; USS too when ``uss`` (it walks the page tables: ~3 ms a rank)."""
        for rank, pid in list(self._pids.items()):
            if rank not in self._procs:
                try:
                    self._procs[rank] = psutil.Process(pid)
                except psutil.Error:
                    self._pids.pop(rank)
        for rank, proc in list(self._procs.items()):
            s = self.ranks[rank]
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    raise psutil.ZombieProcess(proc.pid)
                s.cpu_percent = proc.cpu_percent(None)
                s.rss = proc.memory_info().rss
                if uss:
                    s.uss = proc.memory_full_info().uss
            except psutil.Error:  # exited (a zombie until the kernel reaps it)
                self._procs.pop(rank, None)
                self.lost.add(rank)
                continue
            s.peak_rss, s.peak_uss = max(s.peak_rss, s.rss), max(s.peak_uss, s.uss)
        if self.gpu_indices:
            for g in nvml.backend().sample(self.gpu_indices):
                h = self.gpus[g.index]
                h.last = g
                if g.mem_used is not None:
                    h.peak_mem = max(h.peak_mem, g.mem_used)


def mb(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GB" if n >= 10 * 2**30 else f"{n / 2**20:.0f} MB"


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def uptime(seconds: float) -> str:
    """12 s, 1 min 20 s, 2 h 5 min."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
