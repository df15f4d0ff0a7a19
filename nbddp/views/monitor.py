"""Sampling what ranks use, about once a second: memory per rank (/proc, psutil where there is none), GPUs
(NVML seam).

Memory per CPU rank is shown three ways so copy-on-write is visible: RSS (all resident pages), USS
(pages only this rank has: what it copied or allocated) and shared = RSS - USS (pages still shared
with the notebook and the other ranks).

It costs the kernel well under 1 % of a core (benchmarks/results.md, 3b): RSS is one read of
``/proc/PID/statm`` (~10 µs); USS, from ``/proc/PID/smaps_rollup``, walks the rank's page tables (~5 ms per
rank forked from a kernel with torch), so it is read only when the rank's page faults say it may have moved,
at most every few samples (``Monitor.sample``). A rank's CPU time is not sampled:
no view shows it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..hw import nvml, procmem

USS_EVERY = 5  # samples at least between a rank's USS readings
USS_FAULTS = 256  # page faults since its last reading (1 MiB of 4 KiB pages at least) before a rank's next


@dataclass
class RankSample:
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
        self._pids: dict[int, int] = {}
        self.lost: set[int] = set()  # ranks whose process was gone at a sample
        self.samples = 0
        self._uss_at: dict[int, tuple[int, int]] = {}  # rank -> (sample, its page faults) at its last USS

    def watch(self, rank: int, pid: int) -> None:
        self._pids[rank] = pid
        self.ranks[rank] = RankSample()
        self.lost.discard(rank)  # (a replacement for a rank that was lost)
        self._uss_at.pop(rank, None)

    def forget(self, rank: int) -> None:
        self._pids.pop(rank, None)

    def renumber(self, moves: dict) -> None:
        """Ranks moved (old -> new: a pool shrank); the others forgotten."""
        self._pids = {moves[r]: pid for r, pid in self._pids.items() if r in moves}
        self.ranks = {moves[r]: s for r, s in self.ranks.items() if r in moves}
        self.lost = {moves[r] for r in self.lost if r in moves}
        self._uss_at = {moves[r]: v for r, v in self._uss_at.items() if r in moves}

    def sample(self, force: bool = False) -> None:
        """RSS of every rank; USS (it walks the page tables: ~5 ms a rank forked from a kernel with torch) of
        every rank when ``force``, else when it may have moved: a rank's first reading at sample
        ``rank % USS_EVERY`` (the ranks in turn: no sample walks them all), then at most every ``USS_EVERY``
        samples, and (with /proc) only once the rank has touched ``USS_FAULTS`` new pages since (its page
        faults: a copy-on-write copy or an allocation is one). An idle or steady rank costs no walk."""
        turn = self.samples
        self.samples += 1
        for rank, pid in list(self._pids.items()):
            s = self.ranks[rank]
            try:
                s.rss = procmem.rss_of(pid)
                last = self._uss_at.get(rank)
                if force:
                    due = True
                elif last is None:
                    due = turn >= rank % USS_EVERY
                else:  # (without /proc there are no page faults to ask: every USS_EVERY samples)
                    due = turn - last[0] >= USS_EVERY and (
                        not procmem.PROC or procmem.faults_of(pid) - last[1] >= USS_FAULTS)
                if due:
                    self._read_uss(rank, pid, turn)
            except procmem.Gone:
                self._lost(rank)
                continue
            s.peak_rss = max(s.peak_rss, s.rss)
        if self.gpu_indices:
            for g in nvml.backend().sample(self.gpu_indices):
                h = self.gpus[g.index]
                h.last = g
                if g.mem_used is not None:
                    h.peak_mem = max(h.peak_mem, g.mem_used)

    def read_unread(self) -> None:
        """One USS reading of each rank still here that no sample has read yet (the stagger reaches a rank's
        first at sample ``rank % USS_EVERY``: a short cell's last samples may leave it blank)."""
        for rank, pid in list(self._pids.items()):
            if rank not in self._uss_at:
                try:
                    self._read_uss(rank, pid, self.samples - 1)
                except procmem.Gone:
                    self._lost(rank)

    def _read_uss(self, rank: int, pid: int, turn: int) -> None:
        s = self.ranks[rank]
        faults = procmem.faults_of(pid) if procmem.PROC else 0
        s.uss = procmem.uss_of(pid)
        s.peak_uss = max(s.peak_uss, s.uss)
        self._uss_at[rank] = (turn, faults)

    def _lost(self, rank: int) -> None:
        self._pids.pop(rank, None)
        self.lost.add(rank)


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
