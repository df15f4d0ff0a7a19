"""Where ranks meet: a private run directory, the torchrun environment, the loopback interface.

On one machine nbddp needs no port at all: forked ranks rendezvous on the kernel's store over pipes
(starters.store_pipes), spawned ones through a FileStore in a 0700 directory under the user's cache,
and gloo/NCCL are pinned to the loopback interface, so nothing of a run listens on a non-loopback
address and no rerun ever meets "address already in use".
"""
from __future__ import annotations

import functools
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

KEEP_RUNS = 20  # a kernel keeps its own newest 20 run directories (logs); NBDDP_KEEP_RUNS overrides
KEEP_DAYS = 7.0  # a run of a kernel that is gone is removed once it is this old; NBDDP_KEEP_DAYS overrides


@dataclass(frozen=True)
class RunDir:
    run_id: str
    path: Path

    @property
    def store(self) -> Path:
        return self.path / "store"

    def log(self, rank: int) -> Path:
        return self.path / f"rank{rank}.log"

    def release_store(self) -> None:
        for p in (self.store, Path(str(self.store) + ".lock")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def runs_root() -> Path:
    base = os.environ.get("NBDDP_RUNS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nbddp", "runs"
    )
    return Path(base)


def new_run_dir() -> RunDir:
    root = runs_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    _prune(root)
    now = time.time_ns()  # names sort by start time, so pruning keeps the newest
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now / 1e9))
    run_id = f"{stamp}.{now % 10**9:09d}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    path = root / run_id
    path.mkdir(mode=0o700)
    run = RunDir(run_id, path)
    os.close(os.open(run.store, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # FileStore keeps the mode
    return run


_started_at: dict[str, float] = {}  # runs of dead processes this kernel looked at: when each started
_store_released: set[str] = set()  # ... and whose rendezvous file is gone


def _prune(root: Path) -> None:
    """Remove old run directories, never one another live kernel may still point a user at.

    - this kernel's runs: its newest ``KEEP_RUNS`` stay, older ones go (each kernel prunes only its own);
    - runs of a process that is gone: kept ``KEEP_DAYS`` days from their start, then removed;
      their rendezvous files (which a killed kernel could not remove) are dropped at once;
    - runs of another live process: never touched.

    Cost per launch: one ``listdir`` and one ``kill(pid, 0)`` per other kernel that has runs here; a dead
    process's run has its start time parsed and its store checked once per kernel.
    """
    keep = max(1, _env_number("NBDDP_KEEP_RUNS", KEEP_RUNS, int))
    max_age_s = _env_number("NBDDP_KEEP_DAYS", KEEP_DAYS, float) * 86400
    now = time.time()
    mine, alive = [], {}
    for name in sorted(os.listdir(root)):  # names sort by start time
        run = root / name
        owner = _owner(name)
        if owner is None:
            continue  # not a run directory of ours: leave it alone
        if owner == os.getpid():
            mine.append(run)
            continue
        if owner not in alive:
            alive[owner] = _alive(owner)
        if alive[owner]:
            continue
        if name not in _started_at:
            _started_at[name] = _started(run)
        if now - _started_at[name] > max_age_s:
            shutil.rmtree(run, ignore_errors=True)
        elif name not in _store_released:
            if (run / "store").exists():
                RunDir(run.name, run).release_store()
            _store_released.add(name)
    for old in mine[: max(0, len(mine) - (keep - 1))]:  # room for the run about to start
        shutil.rmtree(old, ignore_errors=True)


def _env_number(name: str, default, kind):
    try:
        return kind(os.environ[name])
    except (KeyError, ValueError):
        return default


def _owner(name: str) -> int | None:
    """The pid of the kernel that made run ``name`` (``DATE-TIME.NS-PID-HEX``), or None."""
    parts = name.split("-")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None


def _started(run: Path) -> float:
    try:
        return time.mktime(time.strptime(run.name.split(".")[0], "%Y%m%d-%H%M%S"))
    except ValueError:
        try:
            return run.stat().st_mtime
        except OSError:
            return time.time()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.lru_cache(maxsize=1)
def loopback_ifname() -> str:
    """Name of the interface that carries 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    try:
        import psutil
    except ImportError:  # psutil missing: the usual name
        return "lo"
    try:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
                return name
    except (psutil.Error, OSError):  # psutil failing: the usual name
        pass
    return "lo"


def torchrun_env(
    *, rank: int, world_size: int, run_id: str, master_port: int, threads: int, ifname: str
) -> dict[str, str]:
    """The environment ``torchrun --standalone`` gives a rank (one node, one role): the same keys
    (tests/test_usergroup.py compares them with a real torchrun's)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        # No store listens here (ranks use the kernel's, or a FileStore); a free loopback port keeps code that reads
        # MASTER_PORT working without ever colliding with a previous run.
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # torch.distributed.elastic's @record writes a failing rank's error here, as under torchrun
        "TORCHELASTIC_ERROR_FILE": str(runs_root() / run_id / f"rank{rank}.error.json"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        # torchrun says True (its agent hosts a TCPStore); here no agent store exists, so code that runs
        # its own env:// rendezvous must host one (the cell's init_process_group joins nbddp's group anyway)
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "GLOO_SOCKET_IFNAME": ifname,
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
        "NBDDP_RANK": str(rank),
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interpreter_env() -> dict:
    """The kernel's environment for a fresh interpreter of nbddp's (a spawned rank, the fresh forkserver):
    its sys.path as PYTHONPATH, so it imports what the kernel would."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
