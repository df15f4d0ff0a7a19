"""The dashboard as a user sees it: JupyterLab on loopback, driven in headless Chromium by Playwright.

CI installs Debian's chromium and sets NBDDP_REQUIRE_BROWSER=1, so this test can never skip there.
"""
import json
import re
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(300)

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "dashboard.png"
SETUP_CELL = "%load_ext nbddp\nimport torch\nX = torch.randn(50_000_000)  # 200 MB, shared copy-on-write"
DDP_CELL = (
    "%%ddp --devices 2\n"
    "import time\n"
    "for step in range(6):\n"
    "    shard = X[rank::world_size]\n"
    "    print(f'rank {rank} step {step} mean {shard.mean():.4f}', flush=True)\n"
    "    time.sleep(0.7)\n"
)


def wait_for_text(page, needles, timeout_s=60) -> str:
    """The first cell output's text (all its outputs) once it contains every needle (the dashboard
    re-renders in place)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        texts = [t for t in page.locator(".jp-OutputArea").all_inner_texts() if t.strip()]
        text = texts[0] if texts else ""
        if all(n in text for n in needles):
            return text
        page.wait_for_timeout(200)
    raise AssertionError(f"never saw {needles} in the dashboard; last: {text!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


POOL_CELLS = [
    "%load_ext nbddp",
    "%ddp start --devices 2",
    "%%ddp\nimport time\nfor step in range(4):\n    print(f'rank {rank} step {step}', flush=True)\n    time.sleep(0.8)\n",
]


@pytest.fixture
def lab(tmp_path):
    yield from _lab(tmp_path, [SETUP_CELL, DDP_CELL])


@pytest.fixture
def pool_lab(tmp_path):
    yield from _lab(tmp_path, POOL_CELLS)


def _lab(tmp_path, cells):
    if not os.path.exists(CHROMIUM):
        if os.environ.get("NBDDP_REQUIRE_BROWSER"):
            pytest.fail(f"{CHROMIUM} is missing but NBDDP_REQUIRE_BROWSER is set (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium); CI runs this test")
    nb = {
        "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": c}
                  for c in cells],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    (tmp_path / "dash.ipynb").write_text(json.dumps(nb))
    token, port = secrets.token_hex(16), free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", "--allow-root", f"--ServerApp.root_dir={tmp_path}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # the server is ready when its REST API answers
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            assert server.poll() is None, "JupyterLab exited during start-up"
            assert time.monotonic() < deadline, "JupyterLab did not answer within 60 s"
            time.sleep(0.2)
    try:
        yield f"{base}/lab/tree/dash.ipynb?token={token}"
    finally:
        procs = psutil.Process(server.pid).children(recursive=True)
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        for p in procs:
            if p.is_running():
                p.kill()
        shutil.rmtree(tmp_path / "rt", ignore_errors=True)


def _open(pw, url):
    browser = pw.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
              "--disable-sync", "--no-first-run"],
    )
    page = browser.new_page(viewport={"width": 1280, "height": 720})
    page.goto(url)
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    return browser, page


def _run_first_cell(page, expect) -> None:
    """Once the kernel is idle: run the first cell (it loads nbddp) and wait until it has run."""
    expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.keyboard.press("Shift+Enter")
    expect(page.locator(".jp-InputPrompt", has_text="[1]:")).to_have_count(1, timeout=60_000)


def test_the_pool_dashboard_in_jupyterlab_follows_later_cells(pool_lab):
    """The pool's output sits in the %ddp start cell; JupyterLab must update it from later cells and
    between cells (display-id updates), which only a real front end can show."""
    from playwright.sync_api import expect, sync_playwright  # noqa: I001

    with sync_playwright() as pw:
        browser, page = _open(pw, pool_lab)
        try:
            _run_first_cell(page, expect)  # %load_ext nbddp
            page.keyboard.press("Shift+Enter")  # %ddp start
            wait_for_text(page, ["nbddp pool · 2 ranks", "0 cell(s) run"])
            page.keyboard.press("Shift+Enter")  # a 3 s pool cell
            busy = wait_for_text(page, ["busy: Cell In[3]"])  # the start cell's output, during the later cell
            assert re.search(r"0\s+\d+\s+cpu\s+busy", busy), busy
            done = wait_for_text(page, ["1 cell(s) run", "Cell In[3] ·", "· ok"])  # after it, between cells
            assert "busy" not in done and re.search(r"1\s+\d+\s+cpu\s+idle", done), done
        finally:
            browser.close()


def test_dashboard_in_jupyterlab(lab):
    from playwright.sync_api import expect, sync_playwright  # noqa: I001

    with sync_playwright() as pw:
        browser, page = _open(pw, lab)
        try:
            _run_first_cell(page, expect)  # %load_ext nbddp
            page.keyboard.press("Shift+Enter")  # the %%ddp cell
            live = wait_for_text(page, ["USS (private)", "rank 0 step", "rank 1 step"])  # last lines
            assert re.search(r"0\s+cpu\s+running", live) and re.search(r"1\s+cpu\s+running", live), live
            for toast in page.locator(".jp-toast-button", has_text="No").all():
                toast.click()
                toast.wait_for(state="hidden", timeout=5_000)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
            streamed = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
            assert "[rank0]:rank 0 step 0" in streamed and "[rank1]:rank 1 step 0" in streamed
            summary = wait_for_text(page, ["peak RSS", "· finished ·"])
            assert re.search(r"0\s+cpu\s+finished\s+0", summary) and re.search(r"1\s+cpu\s+finished\s+0", summary)
        finally:
            browser.close()
