"""JupyterLab's debugger panel in the ranks as a user sees it: JupyterLab on loopback, driven in headless
Chromium by Playwright (test_browser.py's JupyterLab, page and helpers).

The notebook's debugger toggled on, a breakpoint clicked into the gutter of a ``%%ddp --devices 2`` cell
(line 4 of the cell, the ``%%ddp`` line counting): running the cell stops both ranks there; the Callstack
panel lists a frame per rank (``rank 0 · MainThread · <module>``, ``rank 1 · ...``), the cell's line is
highlighted, clicking a rank's frame shows that rank's variables; Continue lets every rank finish with its own
output; the debugger toggled off, the notebook runs ``%%ddp`` cells as before, the breakpoint no longer
stopping them. Screenshots: docs/images/debugger-ranks.png and debugger-ranks-dark.png (the same stop, the
theme switched from the Settings menu). The debug protocol the page spoke is recorded from its websocket
(``DebugLog``) and shown in the assertions' messages.

CI installs Debian's chromium and sets NBDDP_REQUIRE_BROWSER=1, so this test can never skip there.
"""
import json
import re
import struct
import time

import pytest

from test_browser import (
    CHROMIUM,
    IMAGES,
    THEMES,
    WIDTH,
    _dismiss_toasts,
    _lab,
    _run_first_cell,
    cell,
    run_cell,
    wait_for_text,
)

pytestmark = pytest.mark.timeout(180)  # it takes ~30 s

DDP_CELL = ("%%ddp --devices 2\nimport torch\nx = torch.arange(4) + 10 * rank\ntotal = int(x.sum())\n"
            "print('total', rank, total)\n")
BREAK_LINE = 4  # `total = int(x.sum())`, the %%ddp line being line 1
TOTALS = {r: sum(range(4)) + 4 * 10 * r for r in (0, 1)}  # x = [0, 1, 2, 3] + 10 * rank: 6 and 46
AFTER_CELL = "%%ddp --devices 2\nprint('still here', rank * 100)\n"
CELLS = ["%load_ext nbddp", DDP_CELL, AFTER_CELL]
DDP, AFTER = 1, 2  # cell indices
FRAMES = ".jp-DebuggerCallstack-body .jp-DebuggerCallstackFrame-name"
CONTINUE = "jp-button[data-command='debugger:continue']"
DONE = [f"[rank0]:total 0 {TOTALS[0]}", f"[rank1]:total 1 {TOTALS[1]}", "· finished ·"]  # the cell's end

# the Variables panel's tree, its top-level rows: {name: detail} (a number's value, a tensor's type)
VARIABLES = """body => Object.fromEntries([...body.querySelectorAll(':scope jp-tree-view > jp-tree-item')].map(item => [
  item.querySelector(':scope > .jp-DebuggerVariables-name')?.textContent.trim(),
  item.querySelector(':scope > .jp-DebuggerVariables-detail')?.textContent.trim()]))"""


class DebugLog:
    """The debug protocol the page speaks with the kernel (its websocket frames, JSON or the v1 binary
    protocol): (seconds since the start, 'request' | 'reply' | 'event', command or event, its DAP message).
    Made before the page opens the notebook: the kernel's websocket opens once, early."""

    def __init__(self, page):
        self.t0 = time.monotonic()
        self.got: list[tuple[float, str, str, dict]] = []
        self.pending: set[str] = set()  # the requests' msg_ids not answered yet
        page.on("websocket", self._opened)

    def _opened(self, ws) -> None:
        if "/channels" in ws.url:
            ws.on("framesent", self._frame)
            ws.on("framereceived", self._frame)

    def _frame(self, payload) -> None:
        try:
            if isinstance(payload, (bytes, bytearray)):  # v1.kernel.websocket.jupyter.org: offsets, then parts
                n = struct.unpack_from("<Q", payload, 0)[0]
                offs = struct.unpack_from(f"<{n}Q", payload, 8)
                header = json.loads(payload[offs[1]:offs[2]])
                if not header["msg_type"].startswith("debug_"):
                    return
                parent = json.loads(payload[offs[2]:offs[3]])
                content = json.loads(payload[offs[4]:offs[5] if len(offs) > 5 else len(payload)])
            else:
                msg = json.loads(payload)
                header, parent, content = msg["header"], msg.get("parent_header") or {}, msg.get("content") or {}
                if not header["msg_type"].startswith("debug_"):
                    return
            kind = header["msg_type"][len("debug_"):]
            if kind == "request":
                self.pending.add(header["msg_id"])
            elif kind == "reply":
                self.pending.discard(parent.get("msg_id"))
            self.got.append((time.monotonic() - self.t0, kind, content.get("command") or content.get("event"), content))
        except Exception:  # noqa: BLE001 - a frame this reader does not know is not the test's subject
            pass

    def settled(self) -> bool:
        """Every request the page sent has had its reply."""
        return not self.pending

    def mark(self) -> int:
        return len(self.got)

    def failed(self, since: int = 0) -> list[dict]:
        return [m for _, kind, _, m in self.got[since:] if kind == "reply" and not m.get("success", True)]

    def tail(self, n: int = 25) -> str:
        return "\n".join(f"{t:7.2f} {kind:7} {what}: {json.dumps(m.get('arguments', m.get('body')))[:200]}"
                         for t, kind, what, m in self.got[-n:])


def wait_until(page, what: str, check, log: DebugLog, timeout_s=30):
    """``check()``'s value once it is truthy, polled every 100 ms until the deadline (the debug protocol's
    last messages in the failure's message)."""
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        page.wait_for_timeout(100)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {got!r}); the debug protocol's last messages:\n"
                         f"{log.tail()}")


def open_logged(pw, url):
    """test_browser.py's ``_open``, the debug log attached before the page goes to the notebook (the kernel's
    websocket may open before ``_open`` returns)."""
    browser = pw.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
              "--disable-sync", "--no-first-run"],
    )
    page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
    log = DebugLog(page)
    page.goto(url)
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    page.wait_for_function("name => document.body.dataset.jpThemeName === name", arg=THEMES["light"], timeout=30_000)
    return browser, page, log


def switch_theme(page, theme: str) -> None:
    """Settings > Theme > the theme, as a user switches it, once the splash shown meanwhile is gone."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Theme$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{THEMES[theme]}$")).click()
    page.wait_for_function("name => document.body.dataset.jpThemeName === name", arg=THEMES[theme], timeout=30_000)
    page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30_000)  # shown while the theme loads


@pytest.fixture
def dbg_lab(tmp_path):
    yield from _lab(tmp_path, CELLS)


def test_a_breakpoint_in_a_ddp_cell_stops_both_ranks_in_jupyterlabs_debugger_panel(dbg_lab):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser, page, log = open_logged(pw, dbg_lab)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            started = time.monotonic()
            _run_first_cell(page, expect)  # %load_ext nbddp
            _dismiss_toasts(page)
            if page.locator(".jp-FileBrowser").first.is_visible():  # the notebook wider, for the shot
                page.locator(".jp-SideBar [data-id='filebrowser']").first.click()
                page.locator(".jp-FileBrowser").first.wait_for(state="hidden", timeout=10_000)
            # -- the debugger on, its sidebar open ---------------------------------------------------------------
            bug = page.locator(".jp-NotebookPanel-toolbar .jp-DebuggerBugButton").first
            expect(bug).to_have_attribute("aria-pressed", "false", timeout=30_000)
            bug.click()
            expect(bug).to_have_attribute("aria-pressed", "true", timeout=30_000)
            if not page.locator("#jp-debugger-sidebar").is_visible():
                page.locator(".jp-SideBar [data-id='jp-debugger-sidebar']").first.click()
            page.locator("#jp-debugger-sidebar").wait_for(timeout=10_000)
            # -- a breakpoint on line 4 of the %%ddp cell, clicked into its gutter ------------------------------
            ddp = cell(page, DDP)
            numbers = ddp.locator(".cm-gutters .cm-lineNumbers .cm-gutterElement")  # the debugger shows them
            numbers.filter(has_text=re.compile(f"^{BREAK_LINE}$")).wait_for(timeout=10_000)
            at = numbers.all_inner_texts().index(str(BREAK_LINE))  # the gutters' first element is a hidden spacer
            sent = log.mark()
            ddp.locator(".cm-gutters .cm-breakpoint-gutter .cm-gutterElement").nth(at).click()
            expect(ddp.locator(".cm-gutters .cm-breakpoint-gutter .cm-gutterElement").nth(at)
                   .locator(".cm-breakpoint-icon")).to_be_visible(timeout=5_000)
            # JupyterLab dumps the cell and sends its breakpoints ~1 s after a change: wait until the kernel took it
            set_at = wait_until(page, f"setBreakpoints line {BREAK_LINE} answered", lambda: next(
                (m for _, kind, what, m in log.got[sent:] if kind == "reply" and what == "setBreakpoints"
                 and [b.get("line") for b in m.get("body", {}).get("breakpoints", [])] == [BREAK_LINE]), None), log)
            assert set_at["success"] and set_at["body"]["breakpoints"][0]["verified"], set_at
            # -- the cell run: both ranks stop on line 4 -------------------------------------------------------------
            run_at = time.monotonic()
            run_cell(page, DDP)
            names = page.locator(FRAMES)
            shown = wait_until(page, "the Callstack panel lists a frame of rank 0 and one of rank 1",
                               lambda: len(t := names.all_inner_texts()) == 2 and t, log, timeout_s=60)
            stopped_s = time.monotonic() - run_at
            assert sorted(shown) == ["rank 0 · MainThread · <module>", "rank 1 · MainThread · <module>"], shown
            highlighted = ddp.locator(".cm-line.jp-DebuggerEditor-highlight")
            expect(highlighted).to_have_count(1, timeout=10_000)
            assert highlighted.inner_text() == DDP_CELL.splitlines()[BREAK_LINE - 1], highlighted.inner_text()
            assert "total" not in ddp.locator(".jp-OutputArea").inner_text(), "a rank ran past its breakpoint"
            # -- each rank's frame, its own variables -------------------------------------------------------------
            body = page.locator(".jp-DebuggerVariables-body").first
            selected = page.locator(".jp-DebuggerCallstack-body .jp-DebuggerCallstackFrame.selected")
            # what the panel shows by itself at the stop, once the page has had every answer: the frame it selected
            # and the variables of that frame's rank (JupyterLab handles each rank's stopped event on its own)
            at_stop = wait_until(page, "the panel settled at the stop", lambda: log.settled() and selected.count() == 1
                                 and "rank" in (v := body.evaluate(VARIABLES)) and (selected.inner_text(), v["rank"]),
                                 log)
            assert at_stop[0].startswith(f"rank {at_stop[1]} ·"), f"selected {at_stop[0]!r}, shows rank {at_stop[1]}"
            seen = {}
            for r in (0, 1):  # rank 1 last: the screenshot's
                names.filter(has_text=f"rank {r} · MainThread").click()
                seen[r] = wait_until(page, f"the Variables panel shows rank {r}'s variables",
                                     lambda r=r: (v := body.evaluate(VARIABLES)).get("rank") == str(r) and "x" in v
                                     and v,
                                     log)
                assert seen[r]["local_rank"] == str(r) and seen[r]["world_size"] == "2", seen[r]
                assert "total" not in seen[r], f"stopped before line {BREAK_LINE} ran: {seen[r]}"
                expect(selected).to_contain_text(f"rank {r} ·")
            assert not log.failed(), f"debug requests that failed while stopped: {log.failed()}"
            IMAGES.mkdir(parents=True, exist_ok=True)
            page.mouse.move(0, 0)  # no hover in the shot
            page.screenshot(path=str(IMAGES / "debugger-ranks.png"))
            switch_theme(page, "dark")
            expect(names).to_have_count(2)  # the stop as it was, in the other theme
            assert body.evaluate(VARIABLES).get("rank") == "1"
            page.mouse.move(0, 0)
            page.screenshot(path=str(IMAGES / "debugger-ranks-dark.png"))
            switch_theme(page, "light")
            # -- Continue: every rank goes on and ends with its own output -----------------------------------------
            before_continue = log.mark()
            continued_at = time.monotonic()
            page.locator(CONTINUE).first.click()
            out = wait_for_text(page, DONE, index=DDP, timeout_s=60)
            finished_s = time.monotonic() - continued_at
            assert "failed" not in out and "Error" not in out, out
            expect(names).to_have_count(0, timeout=10_000)  # nothing stopped any more
            expect(highlighted).to_have_count(0, timeout=10_000)
            expect(ddp.locator(".jp-InputPrompt")).to_have_text("[2]:", timeout=10_000)
            after_continue = log.failed(before_continue)  # noted, not asserted: see the report's line
            # -- the debugger off: the notebook runs %%ddp cells as before, the breakpoint stops nothing -------------
            bug.click()
            expect(bug).to_have_attribute("aria-pressed", "false", timeout=30_000)
            run_cell(page, AFTER)
            wait_for_text(page, ["[rank0]:still here 0", "[rank1]:still here 100", "· finished ·"], index=AFTER)
            run_cell(page, DDP)  # the cell with the breakpoint, again: it runs through
            again = wait_for_text(page, DONE, index=DDP, timeout_s=60)
            expect(ddp.locator(".jp-InputPrompt")).to_have_text("[4]:", timeout=10_000)
            assert names.count() == 0 and "failed" not in again, again
            assert not errors, f"uncaught errors in the page: {errors}"
            print(f"\nstopped on both ranks {stopped_s:.1f} s after the run; frames {shown}; at the stop the panel "
                  f"selected {at_stop[0].splitlines()[0]!r} and showed rank {at_stop[1]}'s variables; variables rank 0 "
                  f"{ {k: seen[0][k] for k in ('rank', 'x')} } rank 1 { {k: seen[1][k] for k in ('rank', 'x')} }; "
                  f"finished {finished_s:.1f} s after Continue; {len(log.got)} debug messages; replies that failed "
                  f"after Continue: {[(m['command'], m.get('message')) for m in after_continue]}; "
                  f"whole test {time.monotonic() - started:.1f} s")
        except BaseException:  # any failure: its evidence kept, re-raised
            page.screenshot(path="/tmp/test_browser_debugger-failure.png")
            print(f"debug protocol, last messages:\n{log.tail(60)}\npage errors: {errors}")
            raise
        finally:
            browser.close()
