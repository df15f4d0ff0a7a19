"""100 %%ddp cells in one kernel (successes, failures, interrupts): the kernel's footprint stays flat."""
import os
import re

import pytest

pytestmark = pytest.mark.timeout(600)

OK = "%%ddp --devices 2\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nint(t.item())\n"
FAIL = "%%ddp --devices 2\nimport torch.distributed as dist\nif rank == 1:\n    raise ValueError('x')\ndist.barrier()\n"
SLOW = "%%ddp --devices 2\nimport time\nprint('started', flush=True)\ntime.sleep(60)\n"


def footprint(k):
    p = k.process()
    return p.num_fds(), p.num_threads(), len(p.children(recursive=True)), len(os.listdir("/dev/shm"))


def interrupt_once_started(k):
    started = set()

    def watch(kind, content):
        if kind == "stream":
            started.update(re.findall(r"\[rank(\d)\]:started", content.get("text", "")))
            if len(started) == 2 and not watch.sent:
                watch.sent = True
                k.interrupt()

    watch.sent = False
    return k.collect(k.execute(SLOW), timeout=30, on_message=watch)


def test_hundred_cells_mixed(clean_kernel):
    k = clean_kernel
    k.ok(OK)
    before = footprint(k)
    outcomes = {"ok": 0, "fail": 0, "interrupt": 0}
    for i in range(100):
        if i % 20 == 7:
            res = interrupt_once_started(k)
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
    assert footprint(k) == before, f"(fds, threads, children, shm) before {before}"
