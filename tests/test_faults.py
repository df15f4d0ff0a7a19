"""Every fault fails the cell in seconds, names the rank and the cause, and leaves nothing behind."""
import os
import re
import signal
import time

import psutil
import pytest

from kernel import Kernel, said

pytestmark = pytest.mark.timeout(120)

HEALTHY = "%%ddp --devices 2\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())\n"


def shm():
    return set(os.listdir("/dev/shm"))


@pytest.fixture
def faulty(clean_kernel):
    """After a fault: no child left (clean_kernel), no fd/thread/shm growth, and the next %%ddp works."""
    k = clean_kernel
    k.warm_up()
    k.ok(HEALTHY)
    proc = k.process()
    before = (proc.num_fds(), proc.num_threads(), shm())
    yield k
    assert k.ok(HEALTHY).result == "2"
    after = (proc.num_fds(), proc.num_threads(), shm())
    # no growth (the kernel itself may close a transient thread or fd of its own meanwhile)
    assert after[0] <= before[0] and after[1] <= before[1] and after[2] == before[2], (
        f"(fds, threads, /dev/shm) before {before} after {after}")


FAULTS = {
    "segfault": ("import signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
                 r"rank 1 failed: killed by SIGSEGV: a crash in native code"),
    "sigkill": ("import signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n",
                r"rank 1 failed: killed by SIGKILL: killed outright: most often the kernel's out-of-memory killer"),
    "os_exit": ("if rank == 1:\n    os._exit(3)\n", r"rank 1 failed: exited with code 3 before the cell finished"),
    "sys_exit": ("import sys\nif rank == 1:\n    sys.exit(3)\n", r"rank 1 failed: called sys.exit\(3\)"),
    "raise": ("if rank == 1:\n    raise RuntimeError('boom')\n", r"rank 1 failed: RuntimeError: boom"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_rank_fault_while_the_other_waits_in_a_collective(faulty, fault):
    code, expected = FAULTS[fault]
    res = faulty.run(
        "%%ddp --devices 2\nimport torch.distributed as dist\n" + code + "dist.all_reduce(torch.ones(1))\n",
        timeout=30,
    )
    assert res.error and res.error["ename"] == "RankFailure", res
    assert re.search(expected, res.error_text), res.error_text
    assert "rank 0" in res.error_text  # what happened to the other rank is said too
    assert res.seconds < 15


def test_the_same_error_on_every_rank_is_reported_once(faulty):
    res = faulty.run("%%ddp --devices 2\nundefined_name + 1\n", timeout=30)
    text = res.error_text
    assert re.search(r"rank [01] failed: NameError: name 'undefined_name' is not defined", text)
    # the other rank either reported the same error first, or was stopped before it could
    assert re.search(r"rank [01](?: failed the same way|: stopped by nbddp after rank [01] failed)", text), text
    assert text.count("Traceback") == 1


def test_segfault_shows_the_python_stack_of_the_crash(faulty):
    res = faulty.run(
        "%%ddp --devices 2\nimport signal\ndef crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "if rank == 1:\n    crash()\n",
        timeout=30,
    )
    assert "[rank1]:Fatal Python error: Segmentation fault" in res.stderr
    assert re.search(r"\[rank1\]:.*line 4 in crash", res.stderr), res.stderr


def test_hang_is_cut_at_the_timeout_with_every_ranks_stack(faulty):
    res = faulty.run(
        "%%ddp --devices 2 --timeout 5\nimport time, torch.distributed as dist\n"
        "def stuck_forever():\n    while True:\n        time.sleep(0.05)\n"
        "if rank == 0:\n    stuck_forever()\ndist.barrier()\n",
        timeout=30,
    )
    assert res.error["ename"] == "RankFailure"
    text = res.error_text
    assert "--timeout 5s expired with ranks 0-1 still running" in text
    assert re.search(r"rank 0 was here:[\s\S]*line 5 in stuck_forever", text), text
    assert re.search(r"rank 1 was here:[\s\S]*barrier", text), text
    assert 5 <= res.seconds < 5 + 15


def test_interrupt_stops_every_rank_and_keeps_the_kernel(faulty):
    res = faulty.interrupt_when("%%ddp --devices 2\nimport time\nprint('started', flush=True)\ntime.sleep(60)\n",
                                "started", 2)
    assert res.error["ename"] == "KeyboardInterrupt"
    assert res.seconds < 15
    assert faulty.value("1 + 1") == 2


def test_an_interrupt_while_ranks_are_being_forked_orphans_none(faulty):
    """SIGINT lands between two forks: it is held back until both ranks are tracked, then stops them."""
    res = faulty.run(
        "import nbddp.kernel.ranks.starters as L, signal\n_start = L.ForkStarter.start\n"
        "def start(self, spec, *a, **k):\n"
        "    proc = _start(self, spec, *a, **k)\n"
        "    if spec.rank == 0:\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # what Jupyter's interrupt does, mid-launch\n"
        "    return proc\n"
        "L.ForkStarter.start = start\n"
        "try:\n"
        "    get_ipython().run_cell_magic('ddp', '--devices 2', 'import time\\ntime.sleep(60)')\n"
        "finally:\n"
        "    L.ForkStarter.start = _start\n",
        timeout=30,
    )
    assert res.error["ename"] == "KeyboardInterrupt"
    assert "interrupted; nbddp stopped every rank as it started." in res.error_text, res.error_text
    assert res.seconds < 15


def test_unpicklable_result_names_the_variable_and_keeps_the_output(faulty):
    res = faulty.run(
        "%%ddp --devices 2 --out lock value\nimport threading\nprint('still shown')\n"
        "lock = threading.Lock()\nvalue = 42\n"
    )
    assert res.error["ename"] == "ResultError"
    assert "--out lock: rank 0's `lock`: _thread.lock cannot be pickled: TypeError" in res.error_text
    assert "these arrived: value" in res.error_text
    assert said(res.stdout, 0, "still shown"), res.stdout
    assert faulty.value("value") == 42


def test_unpicklable_return_value_of_launch_names_the_type(faulty):
    res = faulty.run("import nbddp, threading\nnbddp.launch(threading.Lock, devices=2)")
    assert res.error["ename"] == "ResultError"
    assert "rank 0's return value: _thread.lock cannot be pickled" in res.error_text
    assert "rank 1's return value: _thread.lock cannot be pickled" in res.error_text


def test_ranks_die_with_the_kernel():
    with Kernel(env={}) as k:
        k.ok("%load_ext nbddp")
        ranks_up = set()

        def watch(kind, content):
            if kind == "stream":
                for first, last in re.findall(r"\[rank(\d)(?:-(\d))?\]:up", content.get("text", "")):  # [rank0-1]: both
                    ranks_up.update(range(int(first), int(last or first) + 1))

        msg = k.execute("%%ddp --devices 2\nimport time\nprint('up', flush=True)\ntime.sleep(120)\n")
        deadline = time.monotonic() + 30
        while len(ranks_up) < 2 and time.monotonic() < deadline:
            try:
                m = k.kc.get_iopub_msg(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty, or the channel closing: poll again
                continue
            if m["parent_header"].get("msg_id") == msg:
                watch(m["msg_type"], m["content"])
        assert len(ranks_up) == 2
        ranks = k.process().children(recursive=True)  # the ranks and their guardians
        assert len(k.process().children()) == 2
        os.kill(k.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks outlived the kernel: {alive}"
