"""A debugger front end over a real kernel's control channel, as JupyterLab's debugger panel talks to it
(``debug_request`` / ``debug_reply``, ``debug_event`` on iopub), with the requests JupyterLab sends."""
from __future__ import annotations

import queue
import time


def is_new_stop(event: dict) -> bool:
    """A ``stopped`` event that says a new stop, not one said again of a rank still stopped (``stillStopped``)."""
    return event["event"] == "stopped" and not event["body"].get("stillStopped")


class DebugClient:
    def __init__(self, kernel):
        self.k, self.seq, self.events = kernel, 0, []

    def request(self, command: str, arguments: dict | None = None, timeout: float = 30) -> dict:
        self.seq += 1
        msg = self.k.kc.session.msg("debug_request", {"type": "request", "seq": self.seq, "command": command,
                                                      "arguments": arguments or {}})
        self.k.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no debug_reply to {command} within {timeout}s")
            try:
                reply = self.k.kc.get_control_msg(timeout=left)
            except queue.Empty:
                continue
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    def ok(self, command: str, arguments: dict | None = None, timeout: float = 30) -> dict:
        reply = self.request(command, arguments, timeout)
        assert reply.get("success"), reply
        return reply.get("body") or {}

    def start(self) -> dict:
        """The debugger toggled on in JupyterLab: initialize, attach, configurationDone; debugInfo's body."""
        self.ok("initialize", {"clientID": "jupyterlab", "clientName": "JupyterLab", "adapterID": "python",
                               "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
                               "supportsVariableType": True, "supportsVariablePaging": True,
                               "supportsRunInTerminalRequest": True, "locale": "en"})
        self.ok("attach")
        self.ok("configurationDone")
        return self.ok("debugInfo")

    def stop(self) -> None:
        """The debugger toggled off."""
        self.ok("disconnect", {"restart": False, "terminateDebuggee": False})  # as JupyterLab sends it

    def breakpoints(self, cell: str, lines: list[int]) -> str:
        """As JupyterLab sets a cell's breakpoints: the whole cell dumped, then its lines; the cell's path."""
        path = self.ok("dumpCell", {"code": cell})["sourcePath"]
        self.ok("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": n} for n in lines],
                                   "sourceModified": False})
        return path

    def pump(self, until, timeout: float = 60, what: str = "") -> list:
        """Debug events until ``until(events)`` holds (events since the client started), or fail at the deadline;
        other iopub messages are set aside for the kernel's collect/follow."""
        deadline = time.monotonic() + timeout
        for key, kept in list(self.k.stray.items()):  # what the kernel's collect/follow set aside
            self.events += [m["content"] for m in kept if m["msg_type"] == "debug_event"]
            self.k.stray[key] = [m for m in kept if m["msg_type"] != "debug_event"]
        while not until(self.events):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"debug events: {what or until} not seen within {timeout}s; saw {self.events[-8:]}")
            try:
                msg = self.k.kc.get_iopub_msg(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if msg["msg_type"] == "debug_event":
                self.events.append(msg["content"])
            else:
                self.k.stray.setdefault(msg["parent_header"].get("msg_id"), []).append(msg)
        return self.events

    def stopped(self, count: int, since: int = 0, timeout: float = 60) -> list[dict]:
        """The bodies of ``count`` new stops after event number ``since``. A stop said again of a rank still
        stopped (``stillStopped``, published after every ``continued``) is not one: counting it, a ``next`` on
        rank 0 seemed done as soon as rank 1's stop was said again, and the next request found rank 0 running."""
        def new_stops(events):
            return [e["body"] for e in events[since:] if is_new_stop(e)]

        self.pump(lambda events: len(new_stops(events)) >= count, timeout, f"{count} stopped event(s)")
        return new_stops(self.events)

    def frames(self, thread_id: int, **args) -> list[dict]:
        return self.ok("stackTrace", {"threadId": thread_id, **args})["stackFrames"]

    def variables(self, frame_id: int, scope: str = "Locals") -> dict:
        scopes = self.ok("scopes", {"frameId": frame_id})["scopes"]
        ref = next(s["variablesReference"] for s in scopes if s["name"] == scope)
        return {v["name"]: v["value"] for v in self.ok("variables", {"variablesReference": ref})["variables"]}

    def threads(self) -> dict[str, int]:
        return {t["name"]: t["id"] for t in self.ok("threads")["threads"]}
