"""Issue 11's guard rails, through a real kernel: --threads N > 1 after the kernel ran an OpenMP op, and
many more CPU ranks than cores (a warning once; interrupt and --timeout still end the run within seconds)."""
import os
import time

import pytest

pytestmark = pytest.mark.timeout(180)

CORES = len(os.sched_getaffinity(0))
MANY = max(64, 16 * CORES)


def test_threads_above_one_after_the_kernel_ran_an_openmp_op_does_not_hang(clean_kernel):
    """The kernel's idle OpenMP threads are released before the fork (they would never come back in a rank)."""
    k = clean_kernel
    k.ok("_a = torch.randn(300, 300); _a @ _a; torch.ones(1 << 22).add_(1);")  # the kernel's OpenMP pool exists
    res = k.ok("%%ddp --devices 2 --threads 2 --timeout 30 --gather n\n"
               "torch.ones(1 << 22).add_(1); _b = torch.randn(300, 300); _b @ _b\nn = torch.get_num_threads()\n",
               timeout=90)
    assert k.value("n") == [2, 2], res.stderr
    k.ok("_a @ _a; torch.ones(1 << 22).add_(1);")  # the kernel's own parallel ops still run


def test_a_pool_with_threads_above_one_after_an_openmp_op_does_not_hang(clean_kernel):
    k = clean_kernel
    k.ok("_a = torch.randn(300, 300); _a @ _a;")
    k.ok("%ddp start --devices 2 --threads 2", timeout=90)
    try:
        k.ok("%%ddp --timeout 30 --gather n\ntorch.ones(1 << 22).add_(1)\nn = torch.get_num_threads()\n", timeout=90)
        assert k.value("n") == [2, 2]
    finally:
        k.ok("%ddp stop")


def test_many_more_cpu_ranks_than_cores_warn_once_and_timeout_ends_them(clean_kernel):
    k = clean_kernel
    cell = (f"%%ddp --devices {MANY} --timeout 3 --ranks-output 0\n"
            "import time\ntorch.distributed.barrier()\ntime.sleep(600)\n")
    start = time.monotonic()
    res = k.run(cell, timeout=120)
    took = time.monotonic() - start
    assert "--timeout 3s expired" in res.error_text
    assert res.stderr.count(f"{MANY} CPU ranks on {CORES} cores") == 1, res.stderr[-2000:]
    assert took < 60, f"--timeout 3 took {took:.0f} s to end {MANY} ranks"
    res = k.run(cell.replace("--timeout 3", "--timeout 1"), timeout=120)
    assert "CPU ranks on" not in res.stderr, "said once per kernel and world size"


def test_interrupt_ends_many_cpu_ranks_within_seconds(clean_kernel):
    k = clean_kernel
    kernel = k.process()
    msg = k.execute(f"%%ddp --devices {MANY} --ranks-output 0\nimport time\ntime.sleep(600)\n")
    deadline = time.monotonic() + 60
    while len(kernel.children()) < 8:  # ranks are being forked
        assert time.monotonic() < deadline, "no ranks started"
        time.sleep(0.05)
    k.km.interrupt_kernel()
    interrupted = time.monotonic()
    res = k.collect(msg, timeout=60)
    assert res.status == "error" and "KeyboardInterrupt" in res.error_text
    assert time.monotonic() - interrupted < 20
