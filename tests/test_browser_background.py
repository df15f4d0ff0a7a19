"""Background cells (``%%ddp --bg``, issue 41) as a user sees them: JupyterLab on loopback, driven in headless
Chromium by Playwright (test_browser.py's JupyterLab, page and helpers).

The notebook cell returns at once and a plain cell runs meanwhile; the background cell's later lines and its
bar keep arriving in its own output (JupyterLab keeps a cell's future after its reply, and nbddp's messages
carry the background cell's request as their parent); after a reload that cell is not live any more (the
known limit: the new page has no future for the old request), and ``%ddp attach`` in a new cell shows the bars
at their state, the last lines, then progress moving to the end. Screenshots: docs/images/states/bg-*.png.

CI installs Debian's chromium and sets NBDDP_REQUIRE_BROWSER=1, so this test can never skip there.
"""
import json
import re
import struct
import time

import pytest

from test_browser import STATES, _dismiss_toasts, _lab, _open, _run_first_cell, cell, run_cell, wait_for_text

pytestmark = pytest.mark.timeout(180)  # it takes ~50 s

STEPS = 250  # of 0.1 s: ~25 s of training, a line every 50 steps
BG_CELL = ("%%ddp --bg\nimport time\nfrom tqdm.auto import tqdm\n"
           f"for i in tqdm(range({STEPS}), desc='train', mininterval=0.1):\n"
           "    if i % 50 == 0:\n        print(f'rank {rank} step {i}', flush=True)\n    time.sleep(0.1)\n"
           "print(f'rank {rank} done', flush=True)\n")
PLAIN_CELL = ("print(1 + 1)\nlosses = [1 / (1 + 0.1 * i) for i in range(50)]  # the notebook's own data\n"
              "plt.figure(figsize=(4, 1.6))\nplt.plot(losses)\nplt.title('meanwhile, in the notebook')\nplt.show()")
CELLS = ["%load_ext nbddp\nimport matplotlib.pyplot as plt", "%ddp start --devices 2", BG_CELL, PLAIN_CELL,
         "%ddp attach"]
BG, PLAIN, ATTACH = 2, 3, 4  # cell indices
BAR = re.compile(r"\[rank(\d)\]:train:\s+(\d+)%")


@pytest.fixture
def bg_lab(tmp_path):
    yield from _lab(tmp_path, CELLS)


def out_text(page, i) -> str:
    return cell(page, i).locator(".jp-OutputArea").inner_text()


def own_line(page, i) -> str:
    """Cell ``i``'s pool-cell line (nbddp pool · cell on ranks 0-1 · 12 s · running · rank 0 45%, ...)."""
    return cell(page, i).locator(".nbddp-line").inner_text().strip()


def bars(page, i) -> dict:
    """{rank: percent} of the bars cell ``i`` shows now."""
    return {int(r): int(p) for r, p in (BAR.search(t).groups() for t in
                                        cell(page, i).locator(".nbddp-bar").all_inner_texts() if BAR.search(t))}


def wait_until(page, what: str, check, timeout_s=60):
    """``check()``'s value once it is truthy, polled every 100 ms until the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        page.wait_for_timeout(100)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def shot_cells(page, first: int, last: int, name: str) -> None:
    """The notebook's cells ``first``..``last`` in one screenshot, scrolled into view."""
    cell(page, first).evaluate("c => c.scrollIntoView({block: 'start'})")
    a, b = cell(page, first).bounding_box(), cell(page, last).bounding_box()
    panel = page.locator(".jp-NotebookPanel-notebook").first.bounding_box()  # above the status bar
    top = a["y"]
    page.screenshot(path=str(STATES / name), clip={"x": a["x"], "y": top, "width": a["width"], "height": min(
        b["y"] + b["height"], panel["y"] + panel["height"]) - top})


class Frames:
    """The kernel's messages the page receives (its websocket frames, JSON or the v1 binary protocol):
    (seconds since the start, msg_type, parent msg_id), to say when a background cell's output arrived."""

    def __init__(self, page):
        self.t0 = time.monotonic()
        self.got: list[tuple[float, str, str, int]] = []
        self.inputs: dict[str, str] = {}  # request msg_id -> the code its execute_input echoed
        self.sockets = 0  # kernel websockets the page opened (a reload opens another)
        self.socket = 0  # which one each frame came on
        page.on("websocket", self._opened)

    def _opened(self, ws) -> None:
        if "/channels" in ws.url:
            self.sockets += 1
            n = self.sockets
            ws.on("framereceived", lambda payload: self._frame(payload, n))

    def _frame(self, payload, socket: int) -> None:
        try:
            if isinstance(payload, (bytes, bytearray)):  # v1.kernel.websocket.jupyter.org: offsets, then parts
                n = struct.unpack_from("<Q", payload, 0)[0]
                offs = struct.unpack_from(f"<{n}Q", payload, 8)
                header = json.loads(payload[offs[1]:offs[2]])
                parent = json.loads(payload[offs[2]:offs[3]])
                end = offs[5] if len(offs) > 5 else len(payload)
                content = json.loads(payload[offs[4]:end]) if header["msg_type"] == "execute_input" else {}
            else:
                msg = json.loads(payload)
                header, parent, content = msg["header"], msg.get("parent_header") or {}, msg.get("content") or {}
            if header["msg_type"] == "execute_input":
                self.inputs[parent.get("msg_id", "")] = content.get("code", "")
            self.got.append((time.monotonic() - self.t0, header["msg_type"], parent.get("msg_id", ""), socket))
        except Exception:  # noqa: BLE001 - a frame this reader does not know is not the test's subject
            pass

    def of(self, parent_id: str, since_socket: int = 1) -> list[tuple[float, str]]:
        return [(t, m) for t, m, p, n in self.got if p == parent_id and n >= since_socket]


def test_a_background_cell_stays_live_a_plain_cell_runs_meanwhile_and_attach_follows_it_after_a_reload(bg_lab):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        made = []  # (its websocket can open before _open returns: Frames listens from the start)
        browser, page = _open(pw, bg_lab, before_goto=lambda p: made.append(Frames(p)))
        try:
            frames = made[0]
            _run_first_cell(page, expect)  # %load_ext nbddp
            _dismiss_toasts(page)
            run_cell(page, 1)
            wait_for_text(page, ["nbddp pool · 2 ranks"], index=1)
            # -- the --bg cell returns at once -------------------------------------------------------------------
            sent = time.monotonic()
            run_cell(page, BG)
            wait_until(page, "the --bg cell returned", lambda: "[3]:" in cell(page, BG).locator(".jp-InputPrompt")
                       .inner_text(), timeout_s=15)
            returned = time.monotonic() - sent
            assert returned < 5 and "background cell [3] sent" in out_text(page, BG), (returned, out_text(page, BG))
            # -- a plain cell meanwhile: its output at once ----------------------------------------------------
            t0 = time.monotonic()
            run_cell(page, PLAIN)
            wait_for_text(page, ["2"], index=PLAIN, timeout_s=5)
            plain_text_s = time.monotonic() - t0
            cell(page, PLAIN).locator(".jp-OutputArea img").wait_for(timeout=30_000)
            plain_plot_s = time.monotonic() - t0
            line = own_line(page, BG)
            assert "· running" in line, f"the background cell ended before the plain cell's output: {line}"
            wait_until(page, "the --bg cell's bars", lambda: len(bars(page, BG)) == 2, timeout_s=30)
            shot_cells(page, BG, PLAIN, "bg-running.png")
            # -- later lines arrive in the --bg cell's own output, its bar moves -------------------------------
            seen = {}  # "rank R step S" -> seconds after the cell was sent, as the page showed it
            before = bars(page, BG)

            def later_lines():
                text = out_text(page, BG)
                for s in (0, 50, 100):
                    for r in (0, 1):
                        if f"[rank{r}]:rank {r} step {s}" in text:
                            seen.setdefault(f"rank {r} step {s}", round(time.monotonic() - sent, 1))
                return len(seen) == 6
            wait_until(page, "[rankN]:rank N step 100 in the --bg cell", later_lines, timeout_s=40)
            after = wait_until(page, "the --bg cell's bars moving",
                               lambda: (b := bars(page, BG)) and all(b[r] > before[r] for r in (0, 1)) and b,
                               timeout_s=10)
            for i in (0, 1, PLAIN):  # nowhere else
                assert "step 100" not in out_text(page, i), out_text(page, i)
            bg_id = next(p for p, code in frames.inputs.items() if code.startswith("%%ddp --bg"))
            late = [t for t, m in frames.of(bg_id) if m in ("stream", "display_data", "update_display_data")]
            reply_at = next(t for t, m in frames.of(bg_id) if m == "execute_reply")
            assert late and max(late) > reply_at + 5, (reply_at, late[-5:])
            # -- a reload: the --bg cell is not live any more; %ddp attach shows it, then follows it ------------
            page.on("dialog", lambda d: d.accept())  # "leave the page?" (unsaved changes): yes
            old_sockets = frames.sockets
            page.reload()
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            expect(page.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=60_000)
            reloaded = time.monotonic() - sent
            _dismiss_toasts(page)
            assert "step" not in out_text(page, BG), "the saved notebook had no output; the page came back empty"
            run_cell(page, ATTACH)
            first = wait_until(page, "%ddp attach: both bars, the last lines, the cell's line",
                               lambda: len(b := bars(page, ATTACH)) == 2 and "[rank1]:rank 1 step 100" in
                               out_text(page, ATTACH) and "· running" in own_line(page, ATTACH) and b, timeout_s=30)
            assert all(first[r] >= after[r] for r in (0, 1)), ("bars at their state now", after, first)
            attached = wait_for_text(page, ["[rank0]:rank 0 step 0", "nbddp pool · cell on ranks 0-1"], index=ATTACH)
            assert attached.count("nbddp pool · cell on ranks 0-1") == 1, attached
            moved = wait_until(page, "the attached bars moving",
                               lambda: (b := bars(page, ATTACH)) and all(b[r] > first[r] for r in (0, 1)) and b,
                               timeout_s=10)
            shot_cells(page, ATTACH, ATTACH, "bg-attached.png")
            done = wait_for_text(page, ["[rank0]:rank 0 done", "[rank1]:rank 1 done", "· ok"], index=ATTACH,
                                 timeout_s=60)
            ended = time.monotonic() - sent
            assert re.fullmatch(r"nbddp pool · cell on ranks 0-1 · [\d.]+ s · ok", own_line(page, ATTACH)), done
            assert wait_until(page, "the bars at 100%", lambda: bars(page, ATTACH) == {0: 100, 1: 100}, timeout_s=5)
            assert "step" not in out_text(page, BG), "the --bg cell's own output is not live after a reload"
            # the pool's view, replayed in the attach cell (the start cell's came back empty too), follows the pool
            # past the cell's end: idle, one cell run
            view = cell(page, ATTACH).locator(".nbddp-pool")
            wait_until(page, "the attach cell's pool view after the cell: idle, 1 cell run",
                       lambda: view.count() == 1 and "· idle ·" in (t := view.inner_text()) and "1 cell run" in t
                       and "busy" not in t, timeout_s=10)
            shot_cells(page, ATTACH, ATTACH, "bg-done.png")
            # the kernel went on sending the --bg cell's messages to the reloaded page, which had no future (and no
            # display id) for that request: JupyterLab dropped them
            dropped = [m for t, m in frames.of(bg_id, since_socket=old_sockets + 1)]
            assert "update_display_data" in dropped and "stream" in dropped, dropped
            print(f"\n--bg cell returned in {returned:.1f} s; plain cell: '2' after {plain_text_s:.2f} s, its plot "
                  f"after {plain_plot_s:.2f} s; lines in the --bg cell (s after it was sent): {seen}; bars "
                  f"{before} -> {after}; last message for the --bg cell at {max(late) - reply_at:.1f} s after its "
                  f"reply ({sum(t > reply_at for t in late)} after it); reloaded at {reloaded:.1f} s; attach: bars "
                  f"{first} -> {moved}, ended at {ended:.1f} s; --bg cell's messages the reloaded page dropped: "
                  f"{ {m: dropped.count(m) for m in sorted(set(dropped))} }")
        finally:
            browser.close()
