"""A pool that outlives its kernel (issue 64) as a user sees it: JupyterLab on loopback, driven in headless Chromium
by Playwright (test_browser.py's JupyterLab, page and helpers). A ``--bg`` training runs; the kernel is killed (as
the out-of-memory killer kills it) and JupyterLab's restarter starts a new one; ``%ddp attach`` in a new cell takes
the pool, shows what the training printed while no kernel held it, then its next lines live, to its end; its state
is there for the next cell. Screenshot: docs/images/states/keep-attached.png.

CI installs Debian's chromium and sets NBDDP_REQUIRE_BROWSER=1, so this test can never skip there.
"""
import os
import re
import signal
import time

import psutil
import pytest

from test_browser import _dismiss_toasts, _lab, _open, _run_first_cell, run_cell, wait_for_text
from test_browser_background import shot_cells, wait_until

pytestmark = pytest.mark.timeout(180)

STEPS = 120  # of 0.1 s: a line each 10 steps
CELLS = ["%load_ext nbddp\nimport os\nprint('kernel', os.getpid())",
         "%ddp start --devices 2",
         "%%ddp --bg\nimport time\ndone = 0\n"
         f"for step in range({STEPS}):\n    done += 1\n    if step % 10 == 0:\n"
         "        print(f'rank {rank} step {step}', flush=True)\n    time.sleep(0.1)\n"
         "print(f'rank {rank} done', flush=True)\n",
         "%load_ext nbddp\n%ddp attach",
         "%%ddp\nprint(f'rank {rank} did {done} steps')"]
START, BG, ATTACH, AFTER = 1, 2, 3, 4
STEP = re.compile(r"^\[rank0(?:-1)?\]:rank 0 step (\d+)$", re.M)


@pytest.fixture
def keep_lab(tmp_path):
    yield from _lab(tmp_path, CELLS)


def test_a_training_goes_on_when_jupyter_restarts_a_killed_kernel_and_attach_shows_it_again(keep_lab):
    from playwright.sync_api import expect, sync_playwright

    ranks: list[int] = []
    with sync_playwright() as pw:
        browser, page = _open(pw, keep_lab)
        try:
            _run_first_cell(page, expect)
            _dismiss_toasts(page)
            kernel = int(re.search(r"kernel (\d+)", wait_for_text(page, ["kernel "], index=0)).group(1))
            run_cell(page, START)
            wait_for_text(page, ["nbddp pool · 2 ranks"], index=START)
            server = psutil.Process(kernel).parent()
            ranks = [p.pid for p in psutil.Process(kernel).children() if "nbddp.keeper" not in " ".join(p.cmdline())]
            assert len(ranks) == 2, ranks
            run_cell(page, BG)
            wait_for_text(page, ["[rank0]:rank 0 step 20"], index=BG, timeout_s=30)
            os.kill(kernel, signal.SIGKILL)  # the out-of-memory killer: JupyterLab's restarter starts another
            killed = time.monotonic()
            wait_until(page, "a new kernel", lambda: _new_kernel(server, kernel), timeout_s=60)
            restarted = time.monotonic() - killed
            for button in page.get_by_role("button", name=re.compile("^(Ok|OK)$")).all():  # "the kernel died"
                button.click()
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
            assert all(psutil.pid_exists(pid) for pid in ranks), "the ranks outlived their kernel"
            run_cell(page, ATTACH)
            text = wait_for_text(page, ["took kept pool", "goes on as background cell", "[rank0]:rank 0 done",
                                        "[rank1]:rank 1 done"], index=ATTACH, timeout_s=60)
            shown = [int(s) for s in STEP.findall(text)]
            assert shown and shown[0] > 20 and shown == list(range(shown[0], STEPS, 10)), \
                f"what it printed while no kernel held the pool, then the rest, each line once: {text}"
            shot_cells(page, ATTACH, ATTACH, "keep-attached.png")
            run_cell(page, AFTER)
            after = wait_for_text(page, ["did"], index=AFTER, timeout_s=30)
            assert f"rank 0 did {STEPS} steps" in after and f"rank 1 did {STEPS} steps" in after, after
            print(f"\nkernel killed at step ~20; a new kernel in {restarted:.1f} s; the attach cell showed steps "
                  f"{shown[0]}..{shown[-1]} and the end")
        finally:
            browser.close()
            for pid in ranks:  # (the pool's ranks, whatever became of them: the keeper goes with them)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _new_kernel(server: psutil.Process, old: int) -> bool:
    """A kernel other than ``old`` runs under JupyterLab's ``server`` (its restarter made it)."""
    try:
        return any(p.pid != old and "ipykernel_launcher" in " ".join(p.cmdline()) for p in server.children())
    except psutil.Error:
        return False
