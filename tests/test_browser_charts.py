"""Issue 50 in a real front end: the charts of what ranks log, the slow rank named, and ``--profile``'s bars, in
JupyterLab's light and dark themes (screenshots in docs/images/states/, every view's text legible, nothing
painted light in the dark theme). Same harness as test_browser.py."""
import re

import pytest

from test_browser import _dismiss_toasts, _lab, _open, _run_first_cell, _shot, cell, run_cell, wait_for_text

pytestmark = pytest.mark.timeout(300)

LOG_CELL = ("%%ddp --devices 2\nimport math, time, nbddp\n"
            "for step in range(60):\n"
            "    time.sleep(0.06 if rank == 1 else 0.02)\n"
            "    nbddp.log(step=step, loss=math.exp(-step / 20) + rank / 50, accuracy=1 - math.exp(-step / 15))\n")
PROFILE_CELL = ("%%ddp --devices 2 --profile 6\nimport time\n"
                "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
                "for step in range(8):\n"
                "    if rank == 1:\n"
                "        time.sleep(0.05)\n"
                "    loss = model(torch.randn(64, 256)).pow(2).mean()\n"
                "    opt.zero_grad(); loss.backward(); opt.step()\n")
CELLS = ["%load_ext nbddp\nimport torch", LOG_CELL, PROFILE_CELL]


@pytest.fixture(params=["light", "dark"])
def charts_lab(request, tmp_path):
    for url in _lab(tmp_path, CELLS, theme=request.param):
        yield url, request.param


def test_charts_the_slow_rank_and_the_profile_in_jupyterlab(charts_lab):
    pytest.importorskip("playwright")
    from playwright.sync_api import expect, sync_playwright

    url, theme = charts_lab
    with sync_playwright() as pw:
        browser, page = _open(pw, url, theme)
        try:
            _run_first_cell(page, expect)
            run_cell(page, 1)
            live = wait_for_text(page, ["loss", "accuracy", "running"], index=1)  # drawn while it runs
            assert "finished" not in live, live
            done = wait_for_text(page, ["finished", "rank 1: ", "× the median step time"], index=1)
            charts = cell(page, 1).locator(".nbddp-charts svg")
            assert charts.count() == 2, done  # a panel per name
            box = charts.first.bounding_box()
            assert box["width"] >= 250 and box["height"] >= 120, box
            _dismiss_toasts(page)  # (JupyterLab's news toast would lie over the view)
            _shot(cell(page, 1), "charts", theme)

            run_cell(page, 2)
            said = wait_for_text(page, ["nbddp profile", "waiting in all_reduce for rank 1"], index=2, timeout_s=120)
            assert re.search(r"rank 0 spends \d+ % of its step waiting", said), said
            assert cell(page, 2).locator(".nbddp-profile svg rect").count() >= 4  # the tracks and their parts
            _dismiss_toasts(page)
            _shot(cell(page, 2), "profile", theme)
        finally:
            browser.close()
