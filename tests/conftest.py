import _posixsubprocess
import os
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import left_behind, pool_in
from kernel import Kernel

# each test process its own keepers' directory (a kept pool's socket: $XDG_RUNTIME_DIR/nbddp), as each login has: a
# pool kept from a kernel one test killed (by default a killed kernel's pool waits 10 minutes) is never listed by
# another process's %load_ext (an nbval notebook's output); its kernels inherit it
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="nbx-", dir="/tmp")
UNIT = os.path.join(os.path.dirname(__file__), "unit")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what looks at the whole machine, so runs alone (README's suite: the rest in parallel workers, then these): every
# test of these files; single tests elsewhere carry @pytest.mark.serial themselves
SERIAL = {
    "tests/test_faults.py",  # no /dev/shm entry more after a fault
    "tests/test_soak.py",  # nor after hundreds of cells
    "tests/test_healing.py",  # nor after a pool healed
    "tests/test_procwait.py",  # how busy a process is, seen from /proc: a loaded machine blurs it
}
# README's parallel workers (--dist loadfile) take a test file at a time, its module's kernel shared by its tests; the
# files of one group are one unit, taken together by one worker, one after the other: a Ray cluster on this machine
# (its fixed ports) one at a time
GROUPS = {"tests/test_ray.py": "ray", "notebooks/10-ray-cluster.ipynb": "ray"}
# the longest units first (measured: --durations), so that no worker starts one when the others are nearly done
FIRST = ("tests/test_ray.py", "notebooks/10-ray-cluster.ipynb", "tests/test_keep.py", "tests/test_forkserver.py",
         "tests/test_debug_panel.py", "tests/test_peers_vs_torchrun.py", "tests/test_browser.py",
         "tests/test_export.py")


def pytest_collection_modifyitems(items):
    """Every test under tests/unit is a ``unit`` test (README's fast command: ``-m unit``); the files of SERIAL
    are ``serial``; the files of FIRST first (each file's tests stay together, in their order)."""
    items.sort(key=lambda item: FIRST.index(rel) if (rel := os.path.relpath(str(item.path), ROOT)) in FIRST
               else len(FIRST))
    for item in items:
        path = str(item.path)
        if path.startswith(UNIT + os.sep):
            item.add_marker(pytest.mark.unit)
        if os.path.relpath(path, ROOT) in SERIAL:
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: a venv without xdist, as the hosted stacks', runs one process)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with GROUPS: a file's tests are one unit of work, a group's files one unit together
    (xdist's own ``loadgroup`` names a group in each test's id, which pytest 9's ids no longer take)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Grouped(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return GROUPS.get(file, file)

    return Grouped(config, log)


def _refused(what):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"a unit test starts no process ({what}): take its @pytest.mark.unit off, or fake it")
    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A ``unit`` test starts no kernel and forks no rank, and that is a rule, not a hope: while it runs (the
    fixtures set up for it too), a fork, a spawn or a subprocess fails at once, naming what was started."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
            if hasattr(os, name):
                mp.setattr(os, name, _refused(f"os.{name}"))
        mp.setattr(_posixsubprocess, "fork_exec", _refused("a subprocess"))
        mp.setattr(subprocess, "_fork_exec", _refused("a subprocess"), raising=False)  # (Python 3.11 on)
        yield


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    os.environ["NBDDP_RUNS_DIR"] = str(d)
    return d


@pytest.fixture(scope="module")
def kernel(runs_dir):
    """One real kernel per test module, with nbddp loaded; every child it leaves is a test failure."""
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok("%load_ext nbddp\nimport torch, os, sys")
        yield k


@pytest.fixture
def clean_kernel(kernel):
    """The module kernel, checked after the test: no rank process may be left behind."""
    yield kernel
    left = left_behind(kernel)
    assert not left, f"processes left behind: {[(p.pid, p.name(), p.status()) for p in left]}"


@pytest.fixture
def pool(clean_kernel):
    """The module kernel with a 2-rank pool, stopped after the test (and then no rank may be left)."""
    yield from pool_in(clean_kernel)
