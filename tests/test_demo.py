"""``nbddp demo`` (issue 35): its output is the notebook's, not ipykernel's transport warning, and a
cell's real error still shows. The demo starts its own kernel: run as a user runs it, in a subprocess."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def demo(*code, timeout=240):
    run = ("import sys, nbddp.demo as d\n" + (f"d.CELLS = {list(code)!r}\n" if code else "")
           + "sys.exit(d.main())")
    return subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": ""})


def test_demo_shows_the_notebook_and_no_transport_warning():
    res = demo()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "back in the notebook: {'weight': (1, 32), 'bias': (1,)}" in res.stdout, res.stdout
    assert "without encryption" not in res.stdout + res.stderr and "WARNING" not in res.stderr, res.stderr


def test_demo_still_shows_a_cells_real_error():
    res = demo("print('before')", "1 / 0", timeout=120)
    assert res.returncode == 1 and "before" in res.stdout, res.stdout + res.stderr
    assert "ZeroDivisionError" in res.stderr and "without encryption" not in res.stderr, res.stderr
