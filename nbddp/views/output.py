"""What the views publish, and where it goes: one output slot updated in place by display id, tables as
padded text, and the place a cell's output goes (``current``).

Every view writes through ``current()``: the cell that runs now (``Here``: the kernel's own streams and
display publisher, as any cell), or, on a background cell's thread, that cell's ``Detached`` place: messages
sent on the kernel's iopub socket with the background cell's own request as their parent (a front end
routes output by the request that made it, so it lands in that cell after the cell returned), also to every
cell that attached to it since (``%ddp attach``: replayed first, then live), and kept for the next attach.
"""
from __future__ import annotations

import sys
import threading
import uuid


class Slot:
    """One output in the cell, updated in place by display id (ipyparallel's pattern: it works in JupyterLab,
    VS Code and Colab alike, and the saved notebook keeps the last state). Bundles are built by the views:
    IPython's formatter machinery costs milliseconds per call, which every short run would pay.

    ``drawn``: the bundle last published (None: never shown)."""

    def __init__(self, prefix: str = ""):
        self.display_id = f"{prefix}{uuid.uuid4().hex[:12]}" if prefix else uuid.uuid4().hex
        self.drawn: dict | None = None

    def show(self, data: dict) -> None:
        """A new output (shown again, each copy stays live)."""
        self._publish(data, update=False)

    def update(self, data: dict) -> None:
        """Redrawn in place, when what it shows changed."""
        if data != self.drawn:
            self._publish(data, update=True)

    def _publish(self, data: dict, update: bool) -> None:
        self.drawn = data
        current().display(data, {}, self.display_id, update=update)


def text_table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as lines of text, each column padded to its widest cell (the header is a row)."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# -- where output goes --------------------------------------------------------------------------------
class Here:
    """The cell running now: the kernel's streams and IPython's display publisher (outside a kernel, text)."""

    @property
    def live(self) -> bool:
        """Whether displays can be shown and updated (a kernel)."""
        from ..ipy.session import running_shell

        return running_shell() is not None

    def write(self, stream: str, text: str) -> None:
        (sys.stderr if stream == "stderr" else sys.stdout).write(text)

    def flush(self, stream: str | None = None) -> None:
        for name in (stream,) if stream else ("stdout", "stderr"):
            (sys.stderr if name == "stderr" else sys.stdout).flush()

    def display(self, data: dict, metadata: dict, display_id: str | None, update: bool = False) -> None:
        from IPython.display import publish_display_data

        publish_display_data(data, metadata, transient={"display_id": display_id} if display_id else None,
                             update=update)


HERE = Here()
_routed = threading.local()


def current():
    """Where this thread's view output goes: a background cell's place on its thread, else ``HERE``."""
    return getattr(_routed, "place", None) or HERE


class routed:
    """``with routed(place):`` this thread's view output goes to ``place``."""

    def __init__(self, place):
        self.place = place

    def __enter__(self):
        self.before, _routed.place = getattr(_routed, "place", None), self.place
        return self.place

    def __exit__(self, *exc):
        _routed.place = self.before


FLUSH_S = 0.05  # a background cell's text goes out at most this late (ipykernel's own streams: 0.2 s)
KEPT_LINES = 500  # of a background cell's text, kept for a cell that attaches later (the logs keep all)
KEPT_DISPLAYS = 200  # of its displays (each bar group, each rank's plot), at their latest state


class Detached:
    """A background cell's output: iopub messages with explicit parents (the background cell's request,
    then each cell that attached), sent from any thread; what was published kept in order for the next
    attach: each display at its latest state, the last ``KEPT_LINES`` lines of text, errors.

    ``kernel``: (session, iopub socket) of ipykernel; ``parent``: the header of the request that ran the
    background cell. Without a kernel (a terminal IPython, a script) text and displays go to this process's
    own streams."""

    def __init__(self, kernel, parent: dict):
        self.session, self.socket = kernel if kernel else (None, None)
        self.targets: list[dict] = [parent]  # parent headers; 0: the background cell itself
        # [kind, key, payload] in order: ("stream", name, text), ("display", id, (data, md)), ("error", None, content)
        self.kept: list[list] = []
        self._displays: dict[str, list] = {}  # display id -> its entry in kept
        # display ids another cell showed (first seen here as an update: the pool's view)
        self._foreign: set[str] = set()
        self._shown: list[set] = [set()]  # per target: display ids it has been shown
        self._pending: list[list] = []  # [name, text] not sent yet, in order
        self._lines = 0
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None

    @property
    def live(self) -> bool:
        return self.session is not None

    # -- the views' calls -------------------------------------------------------------------------
    def write(self, stream: str, text: str) -> None:
        if not text:
            return
        with self._lock:
            if self._pending and self._pending[-1][0] == stream:
                self._pending[-1][1] += text
            else:
                self._pending.append([stream, text])
            self._keep_text(stream, text)
            if self._timer is None:
                self._timer = threading.Timer(FLUSH_S, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self, stream: str | None = None) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for name, text in pending:
                for i in range(len(self.targets)):
                    self._send(i, "stream", {"name": name, "text": text}, f"stream.{name}")

    def display(self, data: dict, metadata: dict, display_id: str | None, update: bool = False) -> None:
        with self._lock:
            self.flush()
            if display_id is None:
                display_id = uuid.uuid4().hex  # kept for a later attach: one entry of its own
            entry = self._displays.get(display_id)
            if entry is None:
                entry = self._displays[display_id] = ["display", display_id, (data, metadata)]
                self.kept.append(entry)
                if len(self._displays) > KEPT_DISPLAYS:  # the oldest go, but the first (the dashboard, the line)
                    oldest = next(e for e in self.kept[1:] if e[0] == "display")
                    self.kept.remove(oldest)
                    del self._displays[oldest[1]]
                if update:
                    self._foreign.add(display_id)
            else:
                entry[2] = (data, metadata)
            for i in range(len(self.targets)):
                self._send_display(i, display_id, data, metadata, update)

    def error(self, ename: str, evalue: str, traceback: list[str]) -> None:
        """The background cell's end, as a failed cell shows it (its traceback lines)."""
        content = {"ename": ename, "evalue": evalue, "traceback": traceback}
        with self._lock:
            self.flush()
            self.kept.append(["error", None, content])
            for i in range(len(self.targets)):
                self._send(i, "error", content, "error")

    # -- attach -------------------------------------------------------------------------------------
    def attach(self, parent: dict) -> None:
        """A cell (another request: a reloaded page, a second tab) gets what was published, then what follows."""
        with self._lock:
            self.flush()
            self.targets.append(parent)
            self._shown.append(set())
            i = len(self.targets) - 1
            for kind, key, payload in self.kept:
                if kind == "stream":
                    self._send(i, "stream", {"name": key, "text": payload}, f"stream.{key}")
                elif kind == "display":
                    self._send_display(i, key, *payload, update=False)
                else:
                    self._send(i, "error", payload, "error")

    # -- internals ----------------------------------------------------------------------------------
    def _keep_text(self, stream: str, text: str) -> None:
        if self.kept and self.kept[-1][0] == "stream" and self.kept[-1][1] == stream:
            self.kept[-1][2] += text
        else:
            self.kept.append(["stream", stream, text])
        self._lines += text.count("\n")
        while self._lines > KEPT_LINES:  # the oldest text goes first; displays and errors stay
            first = next((e for e in self.kept if e[0] == "stream"), None)
            if first is None:
                break
            excess = self._lines - KEPT_LINES
            lines = first[2].splitlines(keepends=True)
            if len(lines) <= excess:
                self.kept.remove(first)
                self._lines -= first[2].count("\n")
            else:
                first[2] = "".join(lines[excess:])
                self._lines -= excess

    def _send_display(self, i: int, display_id: str, data: dict, metadata: dict, update: bool) -> None:
        # an attached cell gets display ids of its own: an update reaches each copy once. Not so another cell's
        # display updated from here (the pool's view, which the pool also updates between cells, from the main
        # thread): an attached copy keeps its id, as %ddp status shows it, so that every later update, whoever
        # sends it, reaches it (a front end routes an update by display id to each output shown with it); the
        # updates sent to the background cell's own request reach it that way, and are not sent again
        foreign = display_id in self._foreign
        target_id = display_id if i == 0 or foreign else f"{display_id}-a{i}"
        first = target_id not in self._shown[i]
        if foreign and i > 0 and update and not first:
            return
        self._shown[i].add(target_id)
        update = update and not (first and i > 0)  # a display the attached cell never saw arrives as new
        content = {"data": data, "metadata": metadata, "transient": {"display_id": target_id}}
        self._send(i, "update_display_data" if update else "display_data", content, "display_data")

    def _send(self, i: int, msg_type: str, content: dict, topic: str) -> None:
        if self.session is None:
            if msg_type == "stream":
                (sys.stderr if content["name"] == "stderr" else sys.stdout).write(content["text"])
            elif msg_type == "error":
                print("\n".join(content["traceback"]), file=sys.stderr)
            elif msg_type == "display_data" and i == 0:
                text = content["data"].get("text/plain")
                if text:
                    print(text)
            return
        self.session.send(self.socket, msg_type, content, parent=self.targets[i], ident=topic.encode())


def kernel_sockets():
    """(session, iopub socket) of the running ipykernel, or None (a terminal IPython, a script)."""
    from ..ipy.session import running_shell

    pub = getattr(running_shell(), "display_pub", None)
    session, socket = getattr(pub, "session", None), getattr(pub, "pub_socket", None)
    return (session, socket) if session is not None and socket is not None else None


def request_header() -> dict:
    """The header of the request running now (the cell that asked): a background cell's output's parent."""
    from ..ipy.session import running_shell

    pub = getattr(running_shell(), "display_pub", None)
    return dict(getattr(pub, "parent_header", None) or {})
