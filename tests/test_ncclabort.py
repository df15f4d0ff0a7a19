"""rank/ncclabort.py without a GPU: the interrupt heard by a thread of its own while the main thread cannot run
a handler, and the rank's communicators aborted only if the same command still runs a second later and the
handler never ran. (The abort itself, on NCCL, was run on an H200: benchmarks/gpu_smoke.py's "NCCL group made
anew".)"""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = r"""
import os, signal, threading, time
from nbddp import timeline
from nbddp.rank import ncclabort
timeline.ABORT_AFTER_S = 0.3
aborted = threading.Event()
busy = []
watch = ncclabort.install(busy, signal.SIGUSR2, abort=aborted.set)
signal.signal(signal.SIGUSR2, lambda *a: None)  # the server's handler calls watch.heard(): called below, by hand,
os.kill(os.getpid(), signal.SIGUSR2)            # where the main thread would be back in Python
watch.heard()  # idle: the handler runs at once
time.sleep(0.6)
print("idle", aborted.is_set())
busy.append(object())
os.kill(os.getpid(), signal.SIGUSR2)  # a call in C returns within the grace, the command ends: no abort
time.sleep(0.1)
busy.clear()
watch.heard()
time.sleep(0.5)
print("ended in time", aborted.is_set())
busy.append(object())
os.kill(os.getpid(), signal.SIGUSR2)  # the handler ran (a cell that catches KeyboardInterrupt goes on): no abort
watch.heard()
time.sleep(0.6)
print("heard", aborted.is_set())
watch.rearm()
os.kill(os.getpid(), signal.SIGUSR2)  # still running after the grace, never back in Python: aborted
print("stuck", aborted.wait(5))
"""


def test_an_interrupt_aborts_only_a_command_stuck_past_the_grace():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert out.stdout.split("\n")[:4] == ["idle False", "ended in time False", "heard False", "stuck True"], out


@pytest.mark.unit
def test_without_a_group_nothing_is_aborted():
    from nbddp.rank import ncclabort

    ncclabort.abort_groups()  # no process group here: a no-op, no error
