"""hw/procwait.py against real processes: one waiting for its peer in a gloo all_reduce is blocked, and so is one
whose main thread waits on a Python Event (the kernel tells those apart by the rank's ``Heard``); one running
Python, one sleeping in time.sleep, one waiting for its next command on a pipe, one waiting while its child
computes, and one gone are not."""
import os
import socket
import subprocess
import sys
import time

import pytest

from nbddp.hw import procwait

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not procwait.tells(), reason="/proc does not tell (not Linux, or wchan hidden)")]

GLOO = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2)
print("joined", flush=True)
if sys.argv[1] == "0":
    dist.all_reduce(torch.ones(1))  # rank 1 never joins it
else:
    time.sleep(600)
"""
PLAIN = {
    "running Python": "print('up', flush=True)\nwhile True:\n    pass\n",
    "in time.sleep": "import time\nprint('up', flush=True)\ntime.sleep(600)\n",
    "reading a pipe": "import sys\nprint('up', flush=True)\nsys.stdin.buffer.read(1)\n",
}


def _start(code: str, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


def _ended(procs) -> None:
    for p in procs:
        p.kill()
        p.wait(timeout=30)


def _blocked_within(pid: int, seconds: float) -> bool:
    """Two looks ``POLL_S`` apart that say blocked, within ``seconds`` (the process settles into its wait)."""
    end = time.monotonic() + seconds
    before = procwait.look(pid)
    while time.monotonic() < end:
        time.sleep(0.1)
        after = procwait.look(pid)
        if procwait.blocked(before, after):
            return True
        before = after
    return False


def test_a_rank_waiting_for_its_peer_in_a_gloo_all_reduce_is_blocked():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [_start(GLOO, str(r), env=env) for r in range(2)]
    try:
        assert [p.stdout.readline() for p in procs] == [b"joined\n"] * 2
        assert _blocked_within(procs[0].pid, 20), procwait.look(procs[0].pid)
        assert not _blocked_within(procs[1].pid, 0.5), "time.sleep: not on a futex"
    finally:
        _ended(procs)


@pytest.mark.parametrize("what", PLAIN)
def test_a_process_not_held_in_native_code_is_not_blocked(what):
    proc = _start(PLAIN[what])
    try:
        assert proc.stdout.readline() == b"up\n"
        assert procwait.look(proc.pid) is not None
        assert not _blocked_within(proc.pid, 1.0), procwait.look(proc.pid)
    finally:
        _ended([proc])


WAITS = """
import multiprocessing as mp, sys, threading
def spin():
    while True:
        pass
child = mp.get_context("fork").Process(target=spin, daemon=True) if sys.argv[1] == "child" else None
if child is not None:
    child.start()
print("up", child.pid if child else 0, flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("child", [False, True], ids=["idle", "child-computes"])
def test_a_main_thread_waiting_on_a_python_event_is_blocked_unless_its_child_computes(child):
    proc = _start(WAITS, "child" if child else "alone")
    kids = []
    try:
        up, pid = proc.stdout.readline().split()
        kids = [int(pid)] if int(pid) else []
        assert up == b"up"
        assert _blocked_within(proc.pid, 5.0) is not child, procwait.look(proc.pid)
    finally:
        for pid in kids:
            os.kill(pid, 9)
        _ended([proc])


def test_a_process_gone_is_not_looked_at():
    proc = _start("pass")
    proc.wait(timeout=30)
    assert procwait.look(proc.pid) is None and not procwait.blocked(None, None)
