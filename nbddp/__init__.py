"""nbddp: run a notebook cell on every GPU (or CPU rank) of a torch.distributed job, from the kernel.

    %load_ext nbddp
    %%ddp --devices 2
    print(rank, world_size)

or, from any Python code: ``nbddp.launch(fn, *args, devices=2)``.
"""
from __future__ import annotations

import os

from .errors import CudaInitialisedError, NbddpError, RankFailure, ResultError, UsageError
from .ipy.session import Environment, environment
from .rank.metrics_log import log
from .wire.shared import SharedSequence, shared

__version__ = "0.1.0"


__all__ = [
    "launch", "Pool", "log", "metrics", "profile", "environment", "Environment", "shared", "SharedSequence",
    "load_ipython_extension",
    "NbddpError", "UsageError", "RankFailure", "ResultError", "CudaInitialisedError",
]


def launch(fn, *args, **opts) -> list:
    """Run ``fn(*args)`` on every rank of a fresh process group; return each rank's return value.

    ``opts`` are ``%%ddp``'s options by keyword, with the same defaults and checks (one table:
    ``nbddp.kernel.options.OPTIONS``): ``devices``, ``accelerator``, ``backend``, ``start_method``,
    ``threads``, ``seed``, ``timeout``, ``ranks_output``, ``prefix``, ``max_lines``, ``max_line_chars``,
    ``max_output_mb``, ``max_value_mb``.
    Each rank sees the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, ...) and an initialised
    ``torch.distributed`` group. Output is relayed as ``[rankN]:`` lines. On failure raises
    :class:`RankFailure` naming the rank and cause, after every rank has been stopped and reaped; a
    return value that cannot come back raises :class:`ResultError` naming the rank.
    """
    from .kernel import options
    from .kernel.cells import engine
    from .rank.jobs import CallJob
    from .views.display import view_for_session
    from .wire.messages import Call

    config = options.config(opts)
    if config.profile is not None:
        raise UsageError("profile: --profile is for %%ddp cells (their optimizer steps); nbddp.launch does not "
                         "profile. Nothing ran.")
    job = CallJob(fn, args, options.max_value_bytes(config))
    outcome = engine.one_shot(Call(job), config, observer=view_for_session())
    return engine.returned(outcome.results())


def metrics():
    """Everything the ranks logged in this kernel (``nbddp.log``, the numbers of their tqdm bars' postfixes),
    as a pandas DataFrame: columns ``cell``, ``rank``, ``step``, ``time``, then one per scalar. A pool's
    cells follow each other, so a curve goes on across cells. Each run's folder has the same rows as
    ``metrics.csv``."""
    from .kernel.metrics import LOGBOOK

    return LOGBOOK.frame()


def profile():
    """The last ``%%ddp --profile`` cell's figures as a pandas DataFrame, a row per rank: rank, steps, step_s,
    compute_s, comm_s, wait_s (part of comm_s), data_s, other_s, in seconds summed over the profiled steps."""
    from .kernel.profile import last

    return last()


def __getattr__(name):
    if name == "Pool":  # imported on first use: %load_ext stays light
        return _pool_module().Pool
    raise AttributeError(f"module 'nbddp' has no attribute {name!r}")


# -- what the kernel side is handed by this package, which sits above every part of it ------------------
# cluster/ and export/ sit above the kernel (they use its starters and options), so the kernel names
# neither: its pool and magic are given them here, each imported on first use (Ray only with a cluster pool).
def _pool_module():
    """kernel/pool.py, a ``--cluster`` pool's gang registered with it."""
    from .kernel import pool

    pool.register_cluster_gang(_cluster_gang)
    return pool


def _cluster_gang(config, plan, **kwargs):
    from .cluster.clustergang import ClusterGang

    return ClusterGang(config, plan, **kwargs)


def _export_cells(cells, **kwargs) -> str:
    from .export.script import export_cells

    return export_cells(cells, **kwargs)


def load_ipython_extension(ipython) -> None:
    from .hw import cuda
    from .ipy import cells
    from .kernel.debugger import rankdebug
    from .kernel.magic import DDPMagics, register_exporter
    from .kernel.ranks import forkserver, keeping, warm
    from .rank import worker
    from .wire import sharedtensor

    # Large tensors allocated from now on use transparent huge pages: a fork then copies far fewer
    # page-table entries (8 GB resident: ~390 ms -> ~30 ms per rank, measured). Read at allocation.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    cells.track(ipython)  # IPython 7.x keeps no file name -> cell map: nbddp keeps one
    cuda.backend().install(ipython, cells)  # first: its environment (NVML-based CUDA checks) holds for torch's import
    sharedtensor.gpu_share = cuda.ipc_share  # the kernel's GPU tensors reach forkserver ranks by CUDA IPC
    waiting = _kept_waiting()
    if keeping.this_notebooks(waiting):
        warm.defer()  # this notebook's kernel back for its pool (%ddp attach): no torch here; the first fork imports it
    else:
        worker.warm_start()  # torch imported once, here, so ranks never import it
        forkserver.at_load()  # a CUDA-clean template for GPU ranks, forked before the kernel can hold CUDA
        warm.start()  # what a real first step imports lazily (DDP: torch._dynamo...), on a thread: forks wait for it
    _pool_module()  # %ddp start's pool, a --cluster one included
    register_exporter(_export_cells)  # %ddp_export's writer
    ipython.register_magics(DDPMagics)
    rankdebug.install(ipython)  # JupyterLab's debugger panel reaches the ranks too
    _say_kept(waiting)


def _kept_waiting() -> list:
    """Pools kept from a kernel that ended (``--keep``), waiting for one; how those that ended meanwhile ended, said."""
    from .kernel.ranks import keeping

    for note in keeping.ended():
        print(f"nbddp: {note}", flush=True)
    return [a for a in keeping.kept() if a.holder_pid is None]


def _say_kept(waiting: list) -> None:
    """The kept pools waiting for a kernel, said at load, with how to take them."""
    from .kernel.ranks import keeping

    if waiting:
        lines = "\n".join(f"  {keeping.describe(a)}" for a in waiting)
        print(f"nbddp: {len(waiting)} kept pool(s) wait for a kernel:\n{lines}\n%ddp attach"
              f"{'' if len(waiting) == 1 else ' ID'} takes {'it' if len(waiting) == 1 else 'one'}, %ddp stop ID ends "
              "one.", flush=True)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext`` / ``%reload_ext``: take back every event handler load registered."""
    from .hw import cuda
    from .kernel.debugger import rankdebug
    from .kernel.magic import DDPMagics

    cuda.backend().uninstall(ipython)
    rankdebug.uninstall()
    DDPMagics.unregister_events(ipython)
