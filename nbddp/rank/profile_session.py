"""``%%ddp --profile [STEPS]`` on a rank: torch.profiler for STEPS steps, begun at the same step on every rank,
its trace written beside the rank's log, and this rank's summary sent back with its ``Result``.

A step is an optimizer step, seen through torch's global optimizer hook (``register_optimizer_step_post_hook``):
no change to the user's code. Only the first optimizer that steps counts (a GAN's two optimizers make one
step, not two). A cell without an optimizer counts steps with ``step()`` (``nbddp.log(step=...)`` calls it);
whichever way counts first is the one that counts for the cell. The profiler starts after step 1 on every
rank, not before the cell: a rank that forked or compiled a second later would otherwise show as a straggler;
it stops after step 1 + STEPS, or when the cell ends (the steps done are the ones summarised). Without
``--profile`` none of this runs: no hook is installed, ``step()`` does nothing.

How a rank's profiled time is split (``summarise``; the window runs from the start mark to the stop mark,
the sum of the profiled steps' wall time, ``step_s``):

* communication (``comm_s``): the intervals of collectives: gloo's own events (``gloo:all_reduce``,
  ``gloo:broadcast``, ...), which gloo records on its worker threads from the collective's start to its
  end, whichever thread has them; on a GPU, NCCL's kernels (``ncclKernel_*``, ``ncclDevKernel_*``). Only if
  neither appears (another backend), the issuing ops ``record_param_comms`` and ``c10d::*`` (on CPU with gloo
  those are the short enqueue, not the collective: ``c10d::allreduce_`` returns at once).
* waiting (``wait_s``, part of ``comm_s``): worked out in the kernel (kernel/profile.py), which has every
  rank's collectives: matched across ranks by their order of issue (the order they start in on the rank: gloo
  runs a rank's collectives in the order they were issued; so do NCCL's kernels on one stream), a rank that
  entered collective i before the last rank did waited ``latest start - its start``, at most the collective's
  duration. The starts are put on one clock: ``time.time()`` read at the start mark, minus the mark's profiler time.
* data loading (``data_s``): DataLoader iteration events (``enumerate(DataLoader)#...__next__``) on the
  thread that ran the step, less what is already communication.
* compute (``compute_s``): the rest of the busy time: the step thread's ops (CPU), or on a GPU the kernels
  that are not NCCL's, less communication and data loading.
* other (``other_s``): the step's wall time less the three above (Python between ops, sleeps, I/O, host
  waits).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import time

MARK_START, MARK_STOP = "nbddp:profile-start", "nbddp:profile-stop"
NO_STEP = "no optimizer step or logged step happened: nothing was profiled"
ONE_STEP = "only one step happened: profiling begins after the first step, so that every rank begins together"
MAX_COLLECTIVES = 50_000  # sent per rank (the trace keeps them all)

_session = None  # the cell's Session while a --profile cell runs


def step() -> None:
    """One step of the running ``--profile`` cell, for a loop without an optimizer; nothing otherwise."""
    session = _session
    if session is not None:
        session.count("log")


def begin(profile, rank: int, accelerator: str):
    """``--profile``'s Session for this cell (``profile``: RunCell's (steps, folder)), or None without it."""
    global _session
    if profile is None:
        return None
    _session = Session(profile[0], profile[1], rank, accelerator)
    return _session


class Session:
    """The profiler of one cell on this rank: started at step 1, stopped at step 1 + ``steps``."""

    def __init__(self, steps: int, folder: str, rank: int, accelerator: str):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.steps, self.folder, self.rank, self.cuda = steps, folder, rank, accelerator == "cuda"
        self.n = 0  # steps counted
        self.source = None  # what counts steps: id(the first optimizer that stepped), or "log"
        self.prof = None
        self.problem = None
        self.t0 = None  # time.time() at the start mark
        self.profiled = 0
        self.hook = register_optimizer_step_post_hook(lambda opt, args, kwargs: self.count(id(opt)))

    def count(self, source) -> None:
        if self.source is None:
            self.source = source
        if source != self.source or self.problem is not None:
            return
        self.n += 1
        try:
            if self.n == 1:
                self._start()
            elif self.prof is not None and self.n == 1 + self.steps:
                self._stop()
        except Exception as e:  # noqa: BLE001 - the user's training goes on; the summary says why
            self.problem = f"the profiler failed: {type(e).__name__}: {e}"

    def _start(self) -> None:
        import torch
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.synchronize()  # the last step's kernels end before the window
        self.prof = tp.profile(activities=activities)
        with kineto_quiet():
            self.prof.start()
        self.t0 = time.time()
        with tp.record_function(MARK_START):
            pass

    def _stop(self) -> None:
        import torch
        import torch.profiler as tp

        if self.cuda:
            torch.cuda.synchronize()  # every kernel of the window is in the trace
        with tp.record_function(MARK_STOP):
            pass
        with kineto_quiet():
            self.prof.stop()
        self.profiled = self.n - 1

    def end(self) -> dict:
        """The cell ended: the hook removed, the profiler stopped, the trace written; this rank's summary."""
        global _session
        _session = None
        self.hook.remove()
        summary = {"rank": self.rank, "steps": 0}
        try:
            if self.prof is not None and self.profiled == 0 and self.problem is None and self.n > 1:
                self._stop()  # the cell ended before STEPS steps: the steps it made
        except Exception as e:  # noqa: BLE001 - torch's profiler: any failure is said
            self.problem = f"the profiler failed: {type(e).__name__}: {e}"
            try:  # never left recording in a pool's rank: the next --profile could not start
                self.prof.stop()
            except Exception:  # noqa: BLE001 - stopped already
                pass
        if self.problem is not None:
            return {**summary, "problem": self.problem}
        if self.prof is None or self.profiled == 0:
            if self.prof is not None:
                with kineto_quiet():
                    self.prof.stop()
            return {**summary, "problem": NO_STEP if self.n == 0 else ONE_STEP}
        try:
            path = os.path.join(self.folder, f"rank{self.rank}.trace.json")
            os.makedirs(self.folder, exist_ok=True)
            self.prof.export_chrome_trace(path)
            os.chmod(path, 0o600)  # private, as every file of a run (its ops name the user's code)
            with open(path) as f:
                trace = json.load(f)
            if "distributedInfo" not in trace:  # (torch writes it when the group is up; HTA reads it)
                trace["distributedInfo"] = distributed_info(self.rank)
                with open(path, "w") as f:
                    json.dump(trace, f)
            return {**summary, **summarise(trace, self.t0), "steps": self.profiled, "asked": self.steps,
                    "trace": path}
        except Exception as e:  # noqa: BLE001 - a trace: any failure is said
            return {**summary, "problem": f"the trace could not be written or read: {type(e).__name__}: {e}"}


KINETO_NOISE = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] .*\n?", re.MULTILINE)


@contextlib.contextmanager
def kineto_quiet():
    """The profiler's start and stop without the lines kineto writes on fd 2 itself (torch 2.13:
    ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start``, no setting turns them off): fd 2 goes
    to a file meanwhile, and whatever else was written there in those milliseconds is written on after."""
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = KINETO_NOISE.sub(b"", held.read())
            if rest:
                os.write(2, rest)


def distributed_info(rank: int) -> dict:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"backend": dist.get_backend(), "rank": dist.get_rank(), "world_size": dist.get_world_size()}
    return {"backend": None, "rank": rank, "world_size": 1}


# -- the summary of one rank's trace (module docstring: the rules) --------------------------------------
NCCL_KERNELS = ("ncclKernel_", "ncclDevKernel_")
ISSUE_OPS = ("record_param_comms", "c10d::")
DATA = "enumerate(DataLoader)"
CPU_OPS = ("cpu_op", "user_annotation", "python_function")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def summarise(trace: dict, t0: float) -> dict:
    """Seconds of compute, communication and data loading in the window, and this rank's collectives as
    (name, start on time.time()'s clock, seconds), in order of issue."""
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and "dur" in e]
    start = next(e for e in events if e["name"] == MARK_START)
    stop = next((e for e in events if e["name"] == MARK_STOP), None)
    lo = start["ts"]
    hi = stop["ts"] + stop["dur"] if stop else max((e["ts"] + e["dur"] for e in events), default=lo)
    thread = start.get("tid")

    def inside(e):
        a, b = max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])
        return (a, b) if b > a else None

    gpu = [e for e in events if e.get("cat") in GPU_WORK]
    comm = [e for e in events if e["name"].startswith("gloo:") or
            (e.get("cat") == "kernel" and e["name"].startswith(NCCL_KERNELS))]
    if not comm:
        comm = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith(ISSUE_OPS)]
    comm_ids = {id(e) for e in comm}
    data = [e for e in events if e["name"].startswith(DATA) and e.get("tid") == thread]
    if gpu:
        busy = [e for e in gpu if id(e) not in comm_ids]
    else:
        busy = [e for e in events if e.get("cat") in CPU_OPS and e.get("tid") == thread and id(e) not in comm_ids
                and not e["name"].startswith(("nbddp:", DATA))]

    def spans(evs):
        return [s for s in map(inside, evs) if s is not None]

    c, d, b = spans(comm), spans(data), spans(busy)
    comm_us = covered(c)
    comm_data_us = covered(c + d)
    collectives = [(_collective_name(e["name"]), t0 + (e["ts"] - lo) / 1e6, e["dur"] / 1e6)
                   for e in sorted(comm, key=lambda e: e["ts"]) if inside(e) is not None][:MAX_COLLECTIVES]
    wall = (hi - lo) / 1e6
    compute, comm_s, data_s = (covered(c + d + b) - comm_data_us) / 1e6, comm_us / 1e6, (comm_data_us - comm_us) / 1e6
    return {"step_s": wall, "compute_s": compute, "comm_s": comm_s, "data_s": data_s,
            "other_s": max(0.0, wall - compute - comm_s - data_s), "collectives": collectives}


def covered(spans: list) -> float:
    """The length of the union of (start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _collective_name(name: str) -> str:
    """``gloo:all_reduce`` -> all_reduce; ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` -> AllReduce."""
    if name.startswith("gloo:"):
        return name[5:]
    if name.startswith(NCCL_KERNELS):
        return name.split("_")[1]
    return name
