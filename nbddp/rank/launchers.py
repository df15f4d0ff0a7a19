"""In a rank: launchers the user's code starts (``mp.spawn``, Lightning's ``ddp_notebook``/``ddp_spawn``,
Accelerate's ``notebook_launcher``, a nested ``torchrun``), and the processes a rank starts dying with it.

A launcher inside a rank would start world_size processes from *each* rank, all inheriting the cell's
process group (they hang in a collective, or fight over one port). Instead:

- ``mp.spawn(fn, args, nprocs=world_size)`` of the user's own function runs ``fn(rank, *args)`` on the
  ranks that already exist, as its author meant (its ``init_process_group`` then joins the cell's group);
- any other launcher fails at once with what to write instead (``LaunchInRankError``).

``guard_descendants()`` makes every process a rank starts (forked workers, subprocesses) die with the rank:
a tiny ``sh`` in the rank's process group waits on a pipe only the rank holds; when the rank ends (the
kernel died and took it along, a crash, or a normal exit) the pipe reads EOF and ``sh`` kills the group.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import shlex
import sys

from ..ipy.session import running_shell
from . import inherit

_state: dict = {}


class LaunchInRankError(RuntimeError):
    """A launcher was started inside a %%ddp rank, where it would multiply the ranks."""


def install(rank: int, world_size: int) -> None:
    """Call once in a rank, after its process group is up."""
    if "rank" in _state:
        return
    _state.update(rank=rank, world_size=world_size)
    _patch_torch_multiprocessing()
    _patch_elastic()
    _patch_subprocess()
    _patch_ipython_shell()


def renumber(rank: int, world_size: int) -> None:
    """The rank's new place (a pool shrunk or resized), for the launchers the user's code starts."""
    _state.update(rank=rank, world_size=world_size)


# -- torch.multiprocessing.spawn / start_processes ---------------------------------------------------
def _patch_torch_multiprocessing() -> None:
    import torch.multiprocessing as mp
    import torch.multiprocessing.spawn as spawn_mod

    bound = inherit.found("launchers")  # what libraries bound to them, asked before they are patched
    originals = {mp.spawn: _spawn, mp.start_processes: _start_processes}
    for mod in (mp, spawn_mod):
        mod.spawn, mod.start_processes = _spawn, _start_processes
    # `from torch.multiprocessing import spawn` done earlier: in the notebook, or in a launcher library
    # (found before the fork: walking every module here costs milliseconds per rank in copy-on-write faults)
    for mod_name, name in [*bound, *(("__main__", n) for n in inherit.LAUNCHER_NAMES)]:
        d = getattr(sys.modules.get(mod_name), "__dict__", None)
        if not isinstance(d, dict):
            continue
        value = d.get(name)
        try:
            if value in originals:
                d[name] = originals[value]
        except TypeError:  # unhashable
            pass


def _spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    return _run_in_rank("torch.multiprocessing.spawn", fn, args, nprocs, join)


def _start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    return _run_in_rank("torch.multiprocessing.start_processes", fn, args, nprocs, join)


def _owner(fn) -> str:
    """The library that started the launch: the function's module, or else a library frame on the stack
    (Accelerate hands the user's own function to torch.distributed.elastic)."""
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # bound method
    module = getattr(fn, "__module__", "") or ""
    if module.startswith(_LIBRARIES):
        return module
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(_LIBRARIES):
            return name
        frame = frame.f_back
    return module


_LIBRARIES = ("lightning", "pytorch_lightning", "accelerate")


def _run_in_rank(launcher: str, fn, args, nprocs: int, join: bool):
    rank, ws = _state["rank"], _state["world_size"]
    owner = _owner(fn)
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    head = (f"rank {rank}: {{what}} starts {nprocs} new process(es) from each rank, but this %%ddp cell "
            f"already runs on {ws} ranks with a process group (they would all inherit it and hang).\n")
    if owner.startswith(("lightning", "pytorch_lightning")):
        raise LaunchInRankError(head.format(what='Lightning\'s strategy="ddp_notebook"/"ddp_spawn"/"ddp_fork"') + (
            f'Write instead: Trainer(strategy="ddp", devices={ws}) (or Fabric(strategy="ddp", devices={ws})): '
            "it uses the cell's ranks."))
    if owner.startswith("accelerate"):
        raise LaunchInRankError(head.format(what="Accelerate's notebook_launcher") + (
            "Write instead: call the training function directly in the cell, e.g. training_function(*args): "
            "Accelerator() picks up the cell's process group."))
    if nprocs != ws or not join:
        raise LaunchInRankError(head.format(what=f"{launcher}({name}, nprocs={nprocs})") + (
            f"Write instead: {name}(rank, *args) directly in the cell (rank is already defined), "
            f"or start the cell with `%%ddp --devices {nprocs}`."))
    if rank == 0:
        print(f"nbddp: {launcher}({name}, nprocs={nprocs}) runs {name}(rank, ...) on this cell's {ws} ranks",
              file=sys.stderr)
    fn(rank, *args)
    return None


# -- torch.distributed.elastic (torchrun's engine; Accelerate's notebook_launcher uses it) -----------
ELASTIC_API = "torch.distributed.launcher.api"


def _patch_elastic() -> None:
    """Patched where it is already imported, else the moment it is (importing it costs ~36 ms per rank)."""
    if ELASTIC_API in sys.modules:
        _patch_elastic_api(sys.modules[ELASTIC_API])
    else:
        sys.meta_path.insert(0, _PatchOnImport(ELASTIC_API, _patch_elastic_api))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patched(spec.loader, self.patch)
        return spec


class _Patched(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


def _patch_elastic_api(api) -> None:
    def launch_agent(config, entrypoint, args, *more, **options):
        rank, ws = _state["rank"], _state["world_size"]
        nprocs = getattr(config, "nproc_per_node", "N")
        if _owner(entrypoint).startswith("accelerate"):
            raise LaunchInRankError(
                f"rank {rank}: Accelerate's notebook_launcher starts {nprocs} new process(es) from each rank, but "
                f"this %%ddp cell already runs on {ws} ranks with a process group.\n"
                "Write instead: call the training function directly in the cell, e.g. training_function(*args): "
                "Accelerator() picks up the cell's process group.")
        _refuse_torchrun(["torchrun", *map(str, [entrypoint, *args])])

    api.launch_agent = launch_agent


# -- a nested torchrun -------------------------------------------------------------------------------
_TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def _is_torchrun(cmd) -> bool:
    if isinstance(cmd, (bytes, os.PathLike)):
        cmd = os.fsdecode(cmd)
    try:
        words = shlex.split(cmd) if isinstance(cmd, str) else [os.fsdecode(w) for w in cmd]
    except (ValueError, TypeError):
        return False
    return any(os.path.basename(w) in _TORCHRUN for w in words)


def _refuse_torchrun(cmd) -> None:
    if _is_torchrun(cmd):
        rank, ws = _state["rank"], _state["world_size"]
        raise LaunchInRankError(
            f"rank {rank}: `{cmd if isinstance(cmd, str) else shlex.join(map(str, cmd))}` would start a whole "
            f"torchrun job from each of this cell's {ws} ranks.\n"
            "Write instead: paste the script's code into the %%ddp cell (its init_process_group joins the "
            "cell's group), or run torchrun from a plain cell (`!torchrun ...` outside %%ddp).")


def _patch_subprocess() -> None:
    import subprocess

    original = subprocess.Popen.__init__

    def __init__(self, args, *a, **k):
        _refuse_torchrun(args)
        original(self, args, *a, **k)

    subprocess.Popen.__init__ = __init__


def _patch_ipython_shell() -> None:
    """``!torchrun ...`` in a cell goes through the shell's system(), which does not use subprocess."""
    shell = running_shell()
    if shell is None:
        return
    for name in ("system", "system_piped", "system_raw", "getoutput"):
        original = getattr(shell, name, None)
        if original is None:
            continue

        def checked(cmd, *a, _original=original, **k):
            _refuse_torchrun(cmd)
            return _original(cmd, *a, **k)

        setattr(shell, name, checked)


# -- every process a rank starts dies with it ------------------------------------------------------
def guard_descendants() -> None:
    """Start the rank's guardian (see the module docstring). Only where the rank leads its own process
    group: ``kill 0`` from the guardian must never reach the kernel's group."""
    if _state.get("guard_fd") is not None or not hasattr(os, "posix_spawn"):
        return
    try:
        if os.getpgid(0) != os.getpid():
            return
    except OSError:
        return
    r, w = os.pipe()  # both close-on-exec: only the guardian's stdin (a dup) survives its exec
    try:
        os.posix_spawn("/bin/sh", ["sh", "-c", "trap '' USR1 INT HUP; read _ ; kill -KILL 0"], dict(os.environ),
                       file_actions=[(os.POSIX_SPAWN_DUP2, r, 0),  # not the rank's output pipes:
                                     (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                                     (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)])
    except OSError:
        os.close(w)
        return
    finally:
        os.close(r)
    _state["guard_fd"] = w
    os.register_at_fork(after_in_child=_forget_guard)


def _forget_guard() -> None:
    """A process forked by the rank must not hold the guardian's pipe open (it would outlive the rank)."""
    fd = _state.pop("guard_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
