"""A real IPython kernel for tests, driven through jupyter_client, with deadlines on every wait."""
from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field

import psutil
from jupyter_client import KernelManager


@dataclass
class CellResult:
    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # text/plain of the execute_result (Out[n])
    error: dict | None = None  # ename, evalue, traceback
    displays: list = field(default_factory=list)  # display_data / update_display_data contents
    comms: list = field(default_factory=list)  # comm_open / comm_msg contents (widget state)
    seconds: float = 0.0
    status: str = ""  # the execute_reply's status: ok | error | aborted
    prompts: list = field(default_factory=list)  # input_request prompts the front end was asked (converse)

    def __str__(self) -> str:  # (a failure's message: the text, and the last display's plain text only)
        last = next((d.get("data", {}).get("text/plain") for d in reversed(self.displays)), None)
        return (f"CellResult(status={self.status!r}, error={self.error!r}, stdout={self.stdout[-4000:]!r}, "
                f"stderr={self.stderr[-4000:]!r}, {len(self.displays)} displays, the last: {last!r})")

    @property
    def bar_states(self) -> dict[str, dict]:
        """Each progress-bar output's last state (what the saved notebook keeps), by its display id."""
        last = {}
        for d in self.displays:
            did = d.get("transient", {}).get("display_id", "")
            if "-bar" in did:
                last[did] = d["data"]
        return last

    @property
    def shown(self) -> str:
        """What the cell showed as text: its stdout, then each display's text/plain (%ddp who and diff's tables)."""
        return self.stdout + "".join(d["data"].get("text/plain", "") for d in self.displays if "data" in d)

    @property
    def error_text(self) -> str:
        if not self.error:
            return self.stderr  # IPython's own UsageError is printed, not raised as an error message
        import re

        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(self.error["traceback"]))


def said(stdout: str, rank: int, text: str, start: bool = False) -> bool:
    """Whether ``rank`` printed the line ``text`` (``start``: a line starting with it): alone
    (``[rank1]:text``) or merged with ranks that printed it too (``[rank0-1]:text``, ``[rank0,2]:text``)."""
    import re

    for spec in re.findall(rf"^\[rank([0-9,\-–]+)\]:{re.escape(text)}{'' if start else '$'}", stdout, re.M):
        for part in spec.split(","):
            lo, _, hi = part.replace("–", "-").partition("-")
            if int(lo) <= rank <= int(hi or lo):
                return True
    return False


class Kernel:
    def __init__(self, env: dict | None = None, kernel_name: str = "python3"):
        self.km = KernelManager(kernel_name=kernel_name)
        self.km.start_kernel(env={**os.environ, **(env or {})})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.stray: dict[str, list] = {}  # iopub messages of other requests, set aside by collect (follow)
        self.shared = False  # another client of a kernel someone else started (another_client)

    def another_client(self) -> "Kernel":
        """A second front end on this kernel (a reloaded page, a second tab): its own session and requests."""
        from jupyter_client.session import Session

        other = Kernel.__new__(Kernel)  # (a session of its own: its shell socket's identity is its session id)
        session = Session(key=self.km.session.key, signature_scheme=self.km.session.signature_scheme)
        other.km, other.kc = self.km, self.km.client(session=session)
        other.kc.start_channels()
        other.kc.wait_for_ready(timeout=60)
        other.stray, other.shared = {}, True
        return other

    def follow(self, msg_id: str, until, timeout: float = 60) -> CellResult:
        """What arrives for request ``msg_id`` after its reply (a background cell's output), from what other
        cells' collection set aside and what arrives now, until ``until(result)`` holds, or fail at the deadline."""
        res = CellResult()
        deadline = time.monotonic() + timeout
        pending = self.stray.pop(msg_id, [])
        while not until(res):
            if pending:
                msg = pending.pop(0)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"follow: not there within {timeout}s; so far: {res}")
                try:
                    msg = self.kc.get_iopub_msg(timeout=min(left, 0.5))
                except queue.Empty:
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    self.stray.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
                    continue
            _add(res, msg["msg_type"], msg["content"])
        if pending:  # what came after: still there for the next follow or collect
            self.stray[msg_id] = pending + self.stray.get(msg_id, [])
        return res

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def process(self) -> psutil.Process:
        return psutil.Process(self.pid)

    def execute(self, code: str) -> str:
        # each test waits for a cell's reply before the next: ipykernel < 6.18 could still abort the
        # next one for a moment after an error (its abort window), which is not what a test asks
        return self.kc.execute(code, stop_on_error=False)

    def converse(self, code: str, answer, timeout: float = 60) -> CellResult:
        """Run ``code`` with an input box, as JupyterLab does: each input_request is answered with
        ``answer(prompt)`` (a str; the prompts asked are in ``res.prompts``)."""
        prompts = []

        def pump():
            while True:
                try:
                    msg = self.kc.get_stdin_msg(timeout=0)
                except queue.Empty:
                    return
                if msg["msg_type"] == "input_request":
                    prompts.append(msg["content"]["prompt"])
                    self.kc.input(answer(msg["content"]["prompt"]))

        res = self.collect(self.kc.execute(code, stop_on_error=False, allow_stdin=True), timeout, between=pump)
        res.prompts = prompts
        return res

    def collect(self, msg_id: str, timeout: float = 60, on_message=None, between=None) -> CellResult:
        """Gather a cell's outputs until the kernel reports idle for it, or fail at the deadline
        (``between()``: called between messages, at least every 50 ms)."""
        res = CellResult()
        start = time.monotonic()
        deadline = start + timeout
        pending = self.stray.pop(msg_id, [])  # what was set aside for it meanwhile (a debug client's pump)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell did not finish within {timeout}s; so far: {res}")
            if between is not None:
                between()
            try:
                msg = pending.pop(0) if pending else self.kc.get_iopub_msg(
                    timeout=left if between is None else min(left, 0.05))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                self.stray.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
                continue
            kind, content = msg["msg_type"], msg["content"]
            if on_message:
                on_message(kind, content)
            _add(res, kind, content)
            if kind == "status" and content["execution_state"] == "idle":
                res.seconds = time.monotonic() - start
                res.status = self._reply(msg_id, deadline)
                return res

    def _reply(self, msg_id: str, deadline: float) -> str:
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]["status"]

    def run(self, code: str, timeout: float = 60) -> CellResult:
        return self.collect(self.execute(code), timeout)

    def ok(self, code: str, timeout: float = 60) -> CellResult:
        res = self.run(code, timeout)
        assert res.error is None, res.error_text + "\n" + res.stderr
        return res

    def value(self, expr: str):
        import ast

        return ast.literal_eval(self.ok(expr).result)

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def interrupt_when(self, code: str, marker: str, count: int, timeout: float = 30) -> CellResult:
        """Run ``code`` and interrupt the kernel once ``count`` distinct ranks printed ``marker``."""
        import re

        seen = set()
        sent = []

        def watch(kind, content):
            if kind == "stream" and not sent:
                for spec in re.findall(rf"\[rank([\d,-]+)\]:{re.escape(marker)}", content.get("text", "")):
                    for part in spec.split(","):  # [rank1]: or merged, [rank0-1]:
                        lo, _, hi = part.partition("-")
                        seen.update(range(int(lo), int(hi or lo) + 1))
                if len(seen) >= count:
                    sent.append(True)
                    self.interrupt()

        res = self.collect(self.execute(code), timeout, on_message=watch)
        assert sent, f"never saw {count} ranks print {marker!r}: {res}"
        return res

    def warm_up(self) -> None:
        """The kernel's first error and first interrupt each create an eventfd of its own: do both
        once before measuring its footprint, so only nbddp's leaks would show."""
        if getattr(self, "_warm", False):
            return
        self.run("raise ValueError('warm-up')")
        self.interrupt_when("%%ddp --devices 2\nimport time\nprint('up', flush=True)\ntime.sleep(60)\n", "up", 2)
        self._warm = True

    def __enter__(self) -> "Kernel":
        return self

    def __exit__(self, *exc) -> None:
        """``with Kernel(...) as k:``: shut down however the test ends, every child it left killed by pid."""
        self.shutdown()

    def shutdown(self) -> None:
        if self.shared:  # another client's: only its channels end
            self.kc.stop_channels()
            return
        kids = []
        try:
            kids = self.process().children(recursive=True)
        except (psutil.NoSuchProcess, AttributeError):  # (AttributeError: shut down already, by the test)
            pass
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)
        for p in kids:  # nothing a test started may outlive it
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass



def _add(res: CellResult, kind: str, content: dict) -> None:
    """One iopub message into ``res``."""
    if kind == "stream":
        if content["name"] == "stdout":
            res.stdout += content["text"]
        else:
            res.stderr += content["text"]
    elif kind == "execute_result":
        res.result = content["data"].get("text/plain")
    elif kind == "error":
        res.error = content
    elif kind in ("display_data", "update_display_data"):
        res.displays.append(content)
    elif kind in ("comm_open", "comm_msg"):
        res.comms.append(content)
