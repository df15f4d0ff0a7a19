"""ipykernel's debugger (the one behind JupyterLab's debugger panel), reached into here and nowhere else.

``hook`` puts kernel/debugger/rankdebug.py's router in front of it: the kernel's ``Debugger.process_request`` (every
``debug_request`` of the control channel) goes to ``Router.process``, which hands on to the original what
is not a rank's; the events of the kernel's debugpy pass ``RankDebugger.on_kernel_event`` first, which
takes the ones that say a rank is waiting for a debugger. What is read of ipykernel's ``Debugger``
(``REQUIRED``) is the same on ipykernel 6.17 (Colab's) and 7.x; another one gets a warning in the kernel's
log and a debugger panel that sees the kernel only, as without nbddp.

Ranks reach the kernel's debugpy adapter on loopback only (``debugpy.listen`` on 127.0.0.1, with the access
token debugpy made): ``rank_setup`` is what a rank needs to connect to it (rank/debugpanel.py)."""
from __future__ import annotations

import os
import sys

# what nbddp reads or replaces on ipykernel's Debugger: (attribute path, what for)
REQUIRED = (
    ("process_request", "every debug request"),
    ("debugpy_client.event_callback", "the kernel debugpy's events"),
    ("event_callback", "sending an event to the front end"),
    ("breakpoint_list", "the breakpoints set"),
    ("stopped_threads", "the kernel's stopped threads"),
    ("accept_variable", "the variables shown"),
    ("is_started", "whether the panel is on"),
)

_state: dict = {}  # "debugger", "restore": while nbddp is in front of this kernel's debugger


class KernelSide:
    """The kernel's own debugger, as kernel/debugger/rankdebug.py uses it."""

    def __init__(self, kernel, debugger, original):
        self.kernel, self.debugger, self.original = kernel, debugger, original

    async def forward(self, msg: dict) -> dict:
        return await self.original(msg)

    def publish(self, event: dict) -> None:
        self.debugger.event_callback(event)

    def breakpoints(self) -> dict:
        return {path: [{"line": b["line"]} for b in found]
                for path, found in list(self.debugger.breakpoint_list.items())}

    def accept_variable(self, name: str) -> bool:
        return self.debugger.accept_variable(name)

    def stopped(self) -> bool:
        return bool(self.debugger.stopped_threads)

    def log(self, text: str) -> None:
        self.kernel.log.warning(text)


def unsupported(debugger) -> str | None:
    """Why this ipykernel's debugger cannot be reached into, or None."""
    for path, what in REQUIRED:
        obj = debugger
        for part in path.split("."):
            if not hasattr(obj, part):
                import ipykernel

                return (f"nbddp: the debugger panel cannot reach the ranks on ipykernel {ipykernel.__version__}: its "
                        f"debugger has no {path} ({what}). The panel works in the kernel as usual; pdb works in the "
                        "ranks (breakpoint(), %ddp debug). Supported: ipykernel 6.17 to 7.x.")
            obj = getattr(obj, part)
    return None


def hook(shell, make) -> str | None:
    """Put nbddp in front of the kernel's debugger (once per kernel): ``make(side)`` (``side``: the kernel's
    own debugger, a ``KernelSide``) gives (``process(request)``, a coroutine function answering every debug
    request, and ``on_event(event)``, True for an event of the kernel's debugpy it took). A line to say
    why not, if this ipykernel's debugger cannot be reached into."""
    kernel = getattr(shell, "kernel", None)
    debugger = getattr(kernel, "debugger", None)
    if debugger is None or _state.get("debugger") is debugger:
        return None  # no debugger here (a plain IPython, a kernel without debugpy), or in place already
    why = unsupported(debugger)
    if why:
        kernel.log.warning(why)
        return why
    original = debugger.process_request
    process, on_event = make(KernelSide(kernel, debugger, original))
    client = debugger.debugpy_client
    kernel_events = client.event_callback

    async def process_request(message):
        return await process(message)

    def event_callback(event):
        if not on_event(event):
            kernel_events(event)

    debugger.process_request = process_request
    client.event_callback = event_callback

    def restore():
        debugger.process_request = original
        client.event_callback = kernel_events

    _state.update(debugger=debugger, restore=restore)
    return None


def unhook() -> None:
    restore = _state.pop("restore", None)
    if restore is not None:
        restore()
    _state.clear()


def active() -> bool:
    """The panel is on (JupyterLab's debugger toggled on for this kernel) and nbddp reaches the ranks."""
    debugger = _state.get("debugger")
    return bool(debugger is not None and debugger.is_started)


def cell_prefix() -> str:
    """Where ipykernel's debugger keeps the notebook's cells (each cell's file name starts so)."""
    from ipykernel.compiler import get_tmp_directory

    return get_tmp_directory()


def notebook_frames() -> set[tuple[str, int]]:
    """(file, line) of the notebook's cells on the calling thread's stack: what a rank forked here inherits
    under its own frames (its debugger's stack traces leave them out)."""
    prefix, found = cell_prefix(), set()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(prefix):
            found.add((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return found


def rank_setup() -> dict | None:
    """While the panel is on: where a rank's debugger connects (the kernel's debugpy adapter, loopback)."""
    if not active():
        return None
    pydevd = sys.modules.get("pydevd")
    setup = getattr(getattr(pydevd, "SetupHolder", None), "setup", None) or {}
    if not setup.get("port"):
        return None
    return {"host": setup.get("client") or "127.0.0.1", "port": setup["port"],
            "access_token": setup.get("access-token"),
            "client_access_token": setup.get("client-access-token"), "kernel_pid": os.getpid()}


def cell_file(shell, body_file: str) -> str:
    """While the panel is on: the file name the kernel gave the running cell, whose breakpoints the panel
    sets (JupyterLab hashes the whole cell, the ``%%ddp`` line too), for the ranks to run the cell under;
    otherwise ``body_file``, the name nbddp gave the cell's body."""
    if not active():
        return body_file
    from . import cells

    number = cells.running(shell)
    names = cells.numbers(shell)
    # the running cell's own frame, the outermost of the notebook's on this stack (the magic runs on the kernel's
    # thread, under it), not the name cached last with its number: turning the panel on, ipykernel runs
    # `debugpy.listen` as a silent cell, cached under the next cell's number; a cell whose text ran before the
    # panel was on keeps its earlier place in the map, so that name came last, and its ranks ran the cell under
    # a file the panel had set no breakpoint in (every breakpoint of that cell missed)
    prefix, found = cell_prefix(), None
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != body_file and name.startswith(prefix) and names.get(name) == number:
            found = name
        frame = frame.f_back
    if found is not None:
        return found
    for name in reversed(list(names)):  # (called from outside the cell's code: the last name cached with its number)
        if names[name] == number and name != body_file:
            return name
    return body_file
