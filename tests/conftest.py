import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import left_behind, pool_in
from kernel import Kernel


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
