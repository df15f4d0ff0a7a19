"""rank/ncclabort.py without a GPU: the interrupt heard by a thread of its own while the main thread cannot run
a handler, and the rank's communicators aborted only if the same command still runs a second later. (The abort
itself, on NCCL, was run on an H200: benchmarks/gpu_smoke.py's "NCCL group made anew".)"""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = r"""
import os, signal, threading, time
from nbddp.rank import ncclabort
ncclabort.ABORT_AFTER_S = 0.3
aborted = threading.Event()
busy = []
signal.signal(signal.SIGUSR2, lambda *a: None)  # a handler that cannot end the command (as one stuck in CUDA)
ncclabort.install(busy, signal.SIGUSR2, abort=aborted.set)
os.kill(os.getpid(), signal.SIGUSR2)  # idle: nothing to free
time.sleep(0.6)
print("idle", aborted.is_set())
busy.append(object())
os.kill(os.getpid(), signal.SIGUSR2)  # the command ends itself within the grace: no abort
time.sleep(0.1)
busy.clear()
time.sleep(0.5)
print("ended in time", aborted.is_set())
busy.append(object())
os.kill(os.getpid(), signal.SIGUSR2)  # still running after the grace: aborted
print("stuck", aborted.wait(5))
"""


def test_an_interrupt_aborts_only_a_command_still_running_after_the_grace():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert out.stdout.split("\n")[:3] == ["idle False", "ended in time False", "stuck True"], out


def test_without_a_group_nothing_is_aborted():
    from nbddp.rank import ncclabort

    ncclabort.abort_groups()  # no process group here: a no-op, no error
