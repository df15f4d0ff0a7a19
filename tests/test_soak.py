"""100 %%ddp cells in one kernel (successes, failures, interrupts): the kernel's footprint stays flat."""
import os

import pytest

pytestmark = pytest.mark.timeout(600)

OK = "%%ddp --devices 2\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())\n"
FAIL = "%%ddp --devices 2\nimport torch.distributed as dist\nif rank == 1:\n    raise ValueError('x')\ndist.barrier()\n"
SLOW = "%%ddp --devices 2\nimport time\nprint('started', flush=True)\ntime.sleep(60)\n"


def footprint(k):
    p = k.process()
    return p.num_fds(), p.num_threads(), len(p.children(recursive=True)), len(os.listdir("/dev/shm"))


def test_hundred_cells_mixed(clean_kernel):
    k = clean_kernel
    k.warm_up()
    k.ok(OK)
    before = footprint(k)
    outcomes = {"ok": 0, "fail": 0, "interrupt": 0}
    for i in range(100):
        if i % 20 == 7:
            res = k.interrupt_when(SLOW, "started", 2)
            assert res.error["ename"] == "KeyboardInterrupt"
            outcomes["interrupt"] += 1
        elif i % 5 == 3:
            res = k.run(FAIL, timeout=30)
            assert res.error["ename"] == "RankFailure"
            outcomes["fail"] += 1
        else:
            assert k.ok(OK, timeout=30).result == "2"
            outcomes["ok"] += 1
    assert outcomes == {"ok": 75, "fail": 20, "interrupt": 5}
    after = footprint(k)
    assert all(a <= b for a, b in zip(after, before)), f"(fds, threads, children, shm) before {before} after {after}"
