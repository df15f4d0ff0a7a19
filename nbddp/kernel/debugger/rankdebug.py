"""JupyterLab's debugger in the ranks: the kernel's debug requests (the Debug Adapter Protocol, on the
control channel) reach the kernel's own debugger and every rank's, as one debugger whose threads are the
kernel's and each rank's (``rank 1 · MainThread``).

How the ranks' debuggers are reached: the kernel's debugger is debugpy, whose adapter listens on loopback.
While the panel is on, a rank connects to it at the start of a cell (rank/debugpanel.py); it is the
kernel's child, so the adapter tells the kernel's debugger of it (a ``debugpyAttach`` event); ``RankDebugger``
then opens a session of its own to the adapter for that process (kernel/debugger/dap.py), gives it the breakpoints
the panel set, and lets it run. Requests are routed by the ids in them: each rank's thread, frame and variable ids are
renumbered into one space of their own (``Ids``), far from the kernel's.

What JupyterLab does, which shapes the rules here: it has no thread list, asks ``stackTrace`` for the last
thread that stopped only (with no ``levels``), and its Continue button sends thread 1. So a stack trace of
a rank's thread without ``levels`` lists every stopped rank's frames, each named by its thread; a
``continue`` or ``pause`` of a thread that is no rank's acts on the kernel and every rank (one action
continues them all); one of a rank's thread acts on that rank. The ipykernel side is ipy/debugger.py.

Which rank threads are stopped (``RankLink.stopped``) is the panel's view, kept under one lock
(``RankDebugger.lock``) by the ranks' reader threads (their ``stopped`` and ``continued`` events) and the
control thread (a ``continue`` or step takes a rank's threads out of it before it is sent). pydevd answers a
``continue`` of a thread that runs only once the thread next goes on (after its next stop): a ``continue``
of a rank whose threads all run (a stop said again that crossed the user's continue) is answered here, not
sent."""
from __future__ import annotations

import ast
import asyncio
import itertools
import os
import threading
import time

from ...ipy import debugger
from ...rank import debugpanel
from .dap import DapError, DapSession, untraced

# rank ids: above any id the kernel's own debugger gives (object addresses < 2**47), exact in JavaScript
FIRST_ID = 1 << 50
CALL_TIMEOUT_S = 10.0
NBDDP_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # nbddp/
KEPT_EVENTS = ("stopped", "continued", "thread")  # a rank's events the panel sees; its output comes through nbddp
RESUMING = ("continue", "next", "stepIn", "stepOut")  # a rank's requests that let its stopped threads go on


class Ids:
    """One kind of id (threads, frames, variables) of every rank, renumbered: ``out(link, local)`` gives
    the panel's id, ``back(id)`` the (link, local id) it stands for."""

    def __init__(self, counter):
        self.counter = counter
        self.fwd: dict[tuple, int] = {}
        self.rev: dict[int, tuple] = {}
        self.lock = threading.Lock()  # (the ranks' reader threads and the control thread all renumber)

    def out(self, link, local: int) -> int:
        key = (link, local)  # (the session, not the pid: a pool's rank attached again reuses its ids)
        with self.lock:
            if key not in self.fwd:
                self.fwd[key] = n = next(self.counter)
                self.rev[n] = key
            return self.fwd[key]

    def back(self, ident):
        return self.rev.get(ident) if isinstance(ident, int) else None

    def forget(self, link) -> None:
        """A rank's session ended: its ids go."""
        with self.lock:
            for key in [k for k in self.fwd if k[0] is link]:
                self.rev.pop(self.fwd.pop(key), None)


class RankLink:
    """One rank's debugger session: its rank, the threads of it that are stopped (local ids). ``lock``
    (the RankDebugger's, shared by every rank) guards ``stopped``, ``quiet`` and ``names``."""

    def __init__(self, pid: int, rank, session: DapSession, inherited=frozenset(), lock=None):
        self.pid, self.rank, self.session = pid, rank, session
        self.inherited = inherited  # (file, line) of the notebook's frames the fork left under the rank's own
        self.lock = lock if lock is not None else threading.RLock()
        self.stopped: set[int] = set()
        self.quiet: set[int] = set()  # threads let go after a pause the user could not see: their continued unsaid
        self.names: dict[int, str] = {}

    def own(self, frames: list) -> list:
        """A stack trace's frames down to the notebook's the fork left under the rank's (the kernel's)."""
        return list(itertools.takewhile(
            lambda f: ((f.get("source") or {}).get("path"), f.get("line")) not in self.inherited, frames))

    def renumbered(self, rank: int) -> None:
        """The rank's number now (the pool's ranks moved: ``RankDebugger.renumbered``)."""
        self.rank = rank

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"

    async def call(self, command: str, arguments: dict | None = None, timeout: float | None = None) -> dict:
        return await asyncio.wait_for(asyncio.wrap_future(self.session.send(command, arguments)),
                                      timeout or CALL_TIMEOUT_S)

    async def threads(self) -> list[dict]:
        """The rank's threads the user has: nbddp's own and the debugger's are left out."""
        reply = await self.call("threads")
        found = [t for t in reply.get("body", {}).get("threads", []) if not t["name"].startswith(("nbddp", "pydevd"))]
        with self.lock:
            self.names.update((t["id"], t["name"]) for t in found)
        return found

    def name(self, local: int):
        with self.lock:
            return self.names.get(local)

    def name_list(self) -> list[tuple]:
        with self.lock:
            return list(self.names.items())


class RankDebugger:
    """The multiplexer. ``kernel``: ipy/debugger.py's ``KernelSide`` (the kernel's own debugger: ``forward``,
    ``publish``, ``breakpoints``, ``accept_variable``)."""

    def __init__(self, kernel):
        self.kernel = kernel
        counter = itertools.count(FIRST_ID)
        self.threads, self.frames, self.refs = Ids(counter), Ids(counter), Ids(counter)
        self.links: dict[int, RankLink] = {}
        self.ranks: dict[int, tuple] = {}  # pid -> (rank, inherited frames), of the ranks the kernel started
        self.exception_filters: dict | None = None
        self.set_breakpoints: dict[str, dict] = {}  # path -> the panel's last setBreakpoints arguments (conditions too)
        # links, clocks and every link's stopped/quiet/names: the ranks' reader threads and the control thread
        # change them; events are published under it too, so that the panel hears them in the order decided
        self.lock = threading.RLock()
        self.registered = threading.Condition(self.lock)
        self.clocks: dict[int, list] = {}  # pid -> [seconds stopped before, stopped since] (stopped_s)
        self.keeper: DapSession | None = None  # (``keep_adapter_listening``)

    # -- the ranks -------------------------------------------------------------------------------
    def rank_started(self, pid: int, rank: int, inherited=frozenset()) -> None:
        with self.registered:
            self.ranks[pid] = (rank, frozenset(inherited))
            if len(self.ranks) > 4096:  # ranks long gone
                self.ranks.pop(next(iter(self.ranks)))
            self.registered.notify_all()

    def renumbered(self, ranks: dict) -> None:
        """The pool's ranks moved (a shrink, a resize: ``supervisor.Moved``): ``ranks`` is pid -> its rank now; the
        panel names each rank's threads, its frames and its errors by the new number."""
        with self.registered:
            for pid, rank in ranks.items():
                if pid in self.ranks:
                    self.ranks[pid] = (rank, self.ranks[pid][1])
                if pid in self.links:
                    self.links[pid].renumbered(rank)

    def on_kernel_event(self, event: dict) -> bool:
        """An event of the kernel's debugger; True if it was about a rank (handled here, not shown)."""
        if event.get("event") != "debugpyAttach":
            return False
        untraced(threading.Thread(target=self._attach, args=(dict(event["body"]),), name="nbddp-debug-attach",
                                  daemon=True)).start()
        return True

    def _attach(self, config: dict) -> None:
        """A rank waiting for a debugger: a session of its own, the panel's breakpoints, then it runs."""
        pid = config.get("subProcessId")
        deadline = time.monotonic() + 2.0
        with self.registered:  # (the fork's child can reach the adapter before the kernel has its pid)
            while pid not in self.ranks and time.monotonic() < deadline:
                self.registered.wait(deadline - time.monotonic())
            rank, inherited = self.ranks.get(pid, (None, frozenset()))
        config["rules"] = [*config.get("rules", []), {"path": NBDDP_DIR, "include": False}]
        initialized = threading.Event()
        link_box: list[RankLink] = []
        ended = []  # the connection announced is one from a panel session since ended (a cell that ran on)

        def on_event(event):
            if event.get("event") == "initialized":
                initialized.set()
            elif event.get("event") == "terminated" and not initialized.is_set():
                ended.append(event)
                initialized.set()
            elif link_box:
                self._rank_event(link_box[0], event)

        session = None
        try:
            connect = config.pop("connect")
            self.keep_adapter_listening(connect)
            session = DapSession(connect["host"], connect["port"], on_event, on_close=lambda: self.gone(pid))
            link = RankLink(pid, rank, session, inherited, self.lock)
            link_box.append(link)
            session.request("initialize", {"clientID": "nbddp", "adapterID": "python", "pathFormat": "path",
                                           "linesStartAt1": True, "columnsStartAt1": True})
            attached = session.send("attach", config)
            if not initialized.wait(CALL_TIMEOUT_S):
                raise DapError("the rank's debugger never said it was initialized")
            if ended:  # debugpy's adapter announces it to the next session; the rank's pydevd answers `terminated`:
                session.close()  # the rank connects anew at its next cell (rank/debugpanel.after_cell)
                return
            with self.lock:  # from now on the panel's setBreakpoints reach it too (twice at worst: harmless)
                self.links[pid] = link
            for arguments in self.breakpoints().values():
                session.request("setBreakpoints", arguments)
            if self.exception_filters is not None:
                session.request("setExceptionBreakpoints", self.exception_filters)
            session.request("configurationDone")
            attached.result(CALL_TIMEOUT_S)
            if not debugger.active():  # the panel went off meanwhile: the rank runs on without it
                self.gone(pid)
        except Exception as e:  # noqa: BLE001 - whatever it was, the rank must not stay held
            self.kernel.log(f"nbddp: the debugger could not attach to pid {pid} (rank {rank}): {e!r}")
            self.gone(pid)
            if session is not None:
                session.close()

    def keep_adapter_listening(self, connect: dict) -> None:
        """Before the first rank's session: one more client of the adapter, connected for as long as the
        adapter lives and never used. debugpy's adapter (1.8.15 to 1.8.22 at least: ``sessions.report_sockets``)
        tells every new client's arrival to its oldest session's client; once the panel turned off, that is a
        rank's session still ending (its client closed, its rank not yet told), the event fails, and the
        exception ends the adapter's accept thread: no client can connect again, neither a rank nor the panel
        itself, until the kernel restarts. This client's session is older than every rank's and never ends."""
        with self.lock:
            if self.keeper is not None and not self.keeper.closed:
                return
            try:
                self.keeper = DapSession(connect["host"], connect["port"], on_event=lambda event: None)
            except OSError as e:  # (the rank's own session says whether the adapter is there)
                self.kernel.log(f"nbddp: the debugger panel's keeper session could not connect: {e!r}")

    def gone(self, pid: int, told: bool = True) -> None:
        """A rank's session ended (the rank did, or the panel let it go): the panel is told its threads
        went on (``told``; not when the panel itself is going), and which rank is still stopped."""
        with self.lock:
            link = self.links.pop(pid, None)
            if link is None:
                return
            stopped, link.stopped = sorted(link.stopped), set()
            self.note_stops()
            if told:
                for local in stopped:
                    self.kernel.publish(_event("continued", threadId=self.threads.out(link, local),
                                               allThreadsContinued=False))
            for ids in (self.threads, self.frames, self.refs):
                ids.forget(link)
            if told:
                self._still_stopped()
        link.session.close()

    def _rank_event(self, link: RankLink, event: dict) -> None:
        kind, body = event.get("event"), dict(event.get("body") or {})
        if kind in ("terminated", "exited"):
            self.gone(link.pid)
            return
        if kind not in KEPT_EVENTS or "threadId" not in body:
            return
        local = body["threadId"]
        if kind == "stopped" and body.get("reason") == "pause":  # (asked of the rank's session: not on its reader)
            untraced(threading.Thread(target=self._paused, args=(link, event), name="nbddp-debug-pause",
                                      daemon=True)).start()
            return
        with self.lock:
            if self.links.get(link.pid) is not link:  # (a session let go: its last events are no one's)
                return
            if kind == "continued" and link.quiet and (local in link.quiet or body.get("allThreadsContinued", True)):
                link.quiet.clear()  # (a pause let go at once, all its threads: never said to be stopped)
                return
            if kind == "stopped":
                link.stopped.add(local)
            elif kind == "continued":  # (pydevd says it of a continue the panel asked for too, before its answer)
                link.stopped.clear() if body.get("allThreadsContinued", True) else link.stopped.discard(local)
            self.note_stops()
            body["threadId"] = self.threads.out(link, local)
            self.kernel.publish({**event, "body": body})
            if kind == "continued":
                self._still_stopped()

    def _paused(self, link: RankLink, event: dict) -> None:
        """A rank paused: said stopped on its thread that runs a notebook cell (pydevd may name another, all
        stopped). Where none does (it waits in nbddp's code, for its next cell or for the kernel) there is nothing
        of the user's to see or step: it goes on at once, unseen (its ``continued`` is not said either)."""
        local = event["body"]["threadId"]
        try:
            shown, paused = _cell_thread(link, local, every=event["body"].get("allThreadsStopped", False))
            if shown is None:
                with self.lock:
                    link.quiet.update(paused)
                link.session.request("continue", {"threadId": local})
                return
            local = shown
        except Exception as e:  # noqa: BLE001 - the rank went, or its debugger cannot say yet: shown stopped, not lost
            self.kernel.log(f"nbddp: {link.label} paused; its stack could not be read ({type(e).__name__}: {e})")
        with self.lock:
            if self.links.get(link.pid) is not link:
                return
            link.stopped.add(local)
            self.note_stops()
            self.kernel.publish({**event, "body": {**event["body"], "threadId": self.threads.out(link, local)}})

    def _still_stopped(self) -> None:
        """JupyterLab clears its view at any ``continued``: a rank still stopped is said again (``stillStopped``:
        no new stop; one the user's continue crossed on its way is answered as a thread that runs)."""
        with self.lock:
            for link, local in self.stopped()[:1]:
                self.kernel.publish(_event("stopped", threadId=self.threads.out(link, local), reason="breakpoint",
                                           allThreadsStopped=False, stillStopped=True))

    def take_stopped(self, link: RankLink | None = None) -> dict:
        """The threads stopped now of ``link`` (or of every rank), as they are let go: no longer said to be
        stopped, at once ({link: [local ids]}). A stop that comes after stays, to be let go on its own."""
        with self.lock:
            links = [link] if link is not None else list(self.links.values())
            taken = {one: sorted(one.stopped) for one in links if one.stopped}
            for one, locals_ in taken.items():
                one.stopped.difference_update(locals_)
            self.note_stops()
        return taken

    def still_stopped(self, taken: dict) -> None:
        """Threads taken out (``take_stopped``) that the rank did not let go after all (it never answered):
        stopped again, as far as the panel knows."""
        with self.lock:
            for link, locals_ in taken.items():
                if self.links.get(link.pid) is link:
                    link.stopped.update(locals_)
            self.note_stops()

    def note_stops(self) -> None:
        """After any rank thread stopped or went on: each rank's clock of time spent stopped, kept."""
        now = time.monotonic()
        with self.lock:
            stopped = {link.pid for link in self.links.values() if link.stopped}
            for pid in stopped:
                clock = self.clocks.setdefault(pid, [0.0, None])
                if clock[1] is None:
                    clock[1] = now
            for pid, clock in self.clocks.items():
                if pid not in stopped and clock[1] is not None:
                    clock[0], clock[1] = clock[0] + now - clock[1], None
            while len(self.clocks) > 4096:  # ranks long gone
                self.clocks.pop(next(iter(self.clocks)))

    def stopped_s(self, pids) -> float:
        """Seconds the longest stopped of these ranks stood stopped in the panel, all told (now included)."""
        now = time.monotonic()
        with self.lock:
            found = [c[0] + (now - c[1] if c[1] is not None else 0.0) for c in map(self.clocks.get, pids) if c]
        return max(found, default=0.0)

    def breakpoints(self) -> dict[str, dict]:
        """setBreakpoints' arguments for each file: the panel's own, over those the kernel's debugger kept
        from before nbddp was loaded (lines only)."""
        kept = {path: {"source": {"path": path}, "breakpoints": lines}
                for path, lines in self.kernel.breakpoints().items()}
        return {**kept, **self.set_breakpoints}

    def stopped(self) -> list[tuple]:
        """(link, local thread id) of every rank thread stopped now."""
        with self.lock:
            return [(link, local) for link in self.links.values() for local in sorted(link.stopped)]

    def stopped_pids(self) -> frozenset:
        with self.lock:
            return frozenset(link.pid for link in self.links.values() if link.stopped)

    def stopped_ids(self) -> list[int]:
        return [self.threads.out(link, local) for link, local in self.stopped()]


def _cell_thread(link: RankLink, local: int, every: bool) -> tuple[int | None, list[int]]:
    """(the rank's paused thread that runs a notebook cell, or None; the threads looked at): ``local`` first, then,
    if ``every`` thread stopped with it, the others."""
    ids = [local]
    if every:
        found = link.session.request("threads").get("body", {}).get("threads", [])
        ids += [t["id"] for t in found if t["id"] != local]
    prefix = debugger.cell_prefix()
    for tid in ids:
        frames = link.session.request("stackTrace", {"threadId": tid}).get("body", {}).get("stackFrames", [])
        if any(((f.get("source") or {}).get("path") or "").startswith(prefix) for f in link.own(frames)):
            return tid, ids
    return None, ids


class Router:
    """Each debug request of the front end to the kernel's debugger, a rank's, or both (``process``)."""

    def __init__(self, ranks: RankDebugger, kernel):
        self.ranks, self.kernel = ranks, kernel

    async def process(self, msg: dict) -> dict:
        """One debug request from the front end: its reply (a failure in a rank's part is said in it: the
        front end waits for a reply to every request)."""
        command, args = msg.get("command"), msg.get("arguments") or {}
        owner = self._owner(args)
        try:
            if owner is not None:
                return await self._to_rank(msg, *owner)
            handler = getattr(self, "_" + str(command), None)
            if handler is not None and command in ROUTED:
                return await handler(msg)
        except Exception as e:  # noqa: BLE001 - a rank gone, a timeout, an answer not as expected
            return _reply(msg, success=False, message=f"nbddp: {command} in a rank's debugger: {e!r}")
        return await self.kernel.forward(msg)

    def _owner(self, args: dict):
        """The rank a request is about (link, {argument: local id}), from the ids it carries."""
        for key, ids in (("threadId", self.ranks.threads), ("frameId", self.ranks.frames),
                         ("variablesReference", self.ranks.refs),
                         ("srcFrameId", self.ranks.frames)):
            found = ids.back(args.get(key))
            if found is not None:
                link, local = found
                return link, {key: local}
        return None

    async def _to_rank(self, msg: dict, link: RankLink, local: dict) -> dict:
        command, args = msg["command"], {**(msg.get("arguments") or {}), **local}
        if command == "richInspectVariables":
            return await self._rich(msg, link, args)
        if command == "copyToGlobals":  # into the rank's own globals, as ipykernel does in the kernel
            command, args = "setExpression", {"expression": f"globals()['{args['dstVariableName']}']",
                                              "value": args["srcVariableName"], "frameId": args["srcFrameId"]}
        taken = {}
        if command in RESUMING:
            with self.ranks.lock:
                stopped = args.get("threadId") in link.stopped if command != "continue" else bool(link.stopped)
                if stopped:  # (a continue or step lets every stopped thread of the rank go on)
                    taken = self.ranks.take_stopped(link)
            if not stopped:  # every thread of it runs (a stop said again crossed this): pydevd would not answer
                if command == "continue":
                    return _reply(msg, body={"allThreadsContinued": False})
                return _reply(msg, success=False, message=f"{link.label}: the thread is not stopped")
        try:
            reply = await link.call(command, args)
        except (DapError, asyncio.TimeoutError) as e:
            if isinstance(e, asyncio.TimeoutError):
                self.ranks.still_stopped(taken)
            return _reply(msg, success=False,
                          message=f"{link.label}: {str(e) or f'no answer within {CALL_TIMEOUT_S:g} s'}")
        body = reply.get("body") or {}
        if command == "stackTrace":
            body = await self._stack(link, args, body)
        elif command == "variables":
            body["variables"] = [v for v in body.get("variables", []) if self.kernel.accept_variable(v["name"])]
        return {**reply, "seq": msg.get("seq"), "request_seq": msg.get("seq"), "command": msg["command"],
                "body": self._renumbered(link, body)}

    async def _stack(self, link: RankLink, args: dict, body: dict) -> dict:
        """A rank thread's frames, named by its thread; without ``levels`` (JupyterLab), every other
        stopped rank's after them."""
        frames = await self._named(link, args["threadId"], body.get("stackFrames", []))
        if "levels" not in args:
            for other, local in self.ranks.stopped():
                if (other, local) == (link, args["threadId"]):
                    continue
                try:
                    more = await other.call("stackTrace", {"threadId": local})
                except (DapError, asyncio.TimeoutError):
                    continue
                frames += await self._named(other, local, (more.get("body") or {}).get("stackFrames", []))
        return {**body, "stackFrames": frames, "totalFrames": len(frames)}

    async def _named(self, link: RankLink, local: int, frames: list) -> list:
        name = link.name(local)
        if name is None:
            await link.threads()
            name = link.name(local) or "thread"
        own = link.own(frames)
        return [{**f, "id": self.ranks.frames.out(link, f["id"]),
                 "name": f"{link.label} · {name} · {f.get('name', '')}"}
                for f in own]

    def _renumbered(self, link: RankLink, value):
        """A rank's reply body with its thread and variable ids in the panel's space."""
        if isinstance(value, list):
            return [self._renumbered(link, v) for v in value]
        if not isinstance(value, dict):
            return value
        out = {}
        for key, v in value.items():
            if key == "variablesReference" and isinstance(v, int) and v > 0:
                out[key] = self.ranks.refs.out(link, v)
            elif key == "threadId" and isinstance(v, int):
                out[key] = self.ranks.threads.out(link, v)
            else:
                out[key] = self._renumbered(link, v)
        return out

    async def _rich(self, msg: dict, link: RankLink, args: dict) -> dict:
        """A rank's variable shown as the notebook would show it (its MIME bundle, made in the rank); a name
        that is no variable's (JupyterLab's "special variables" group) has none, as in ipykernel."""
        if not str(args.get("variableName", "")).isidentifier():
            return _reply(msg, body={"data": {}, "metadata": {}})
        expression = f"__import__('nbddp.rank.debugpanel', fromlist=['rich']).rich({args['variableName']})"
        try:
            reply = await link.call("evaluate",
                                    {"expression": expression, "frameId": args["frameId"], "context": "clipboard"})
        except (DapError, asyncio.TimeoutError) as e:
            return _reply(msg, success=False, message=f"{link.label}: {e}")
        data, metadata = ({}, {})
        if reply.get("success"):
            try:
                data, metadata = ast.literal_eval(reply["body"]["result"])
            except (ValueError, SyntaxError):
                data = {"text/plain": reply["body"]["result"]}
        return _reply(msg, body={"data": data, "metadata": {k: v for k, v in metadata.items() if k in data}})

    # -- the requests about the whole debugger --------------------------------------------------
    async def _threads(self, msg: dict) -> dict:
        reply = await self.kernel.forward(msg)
        threads = list((reply.get("body") or {}).get("threads", []))
        for link in list(self.ranks.links.values()):
            try:
                found = await link.threads()
            except (DapError, asyncio.TimeoutError):
                continue
            threads += [{"id": self.ranks.threads.out(link, t["id"]), "name": f"{link.label} · {t['name']}"}
                        for t in found]
        return {**reply, "body": {**(reply.get("body") or {}), "threads": threads}}

    async def _continue(self, msg: dict) -> dict:
        """A thread that is no rank's (JupyterLab's Continue sends thread 1): the kernel and every rank."""
        # (the kernel's own debugger leaves a continue of a thread that runs unanswered)
        reply = await self.kernel.forward(msg) if self.kernel.stopped() else _reply(msg)
        # all go on: none is said to be stopped still when the others' `continued` come (one continue a rank:
        # it lets all its threads go)
        targets = {link: locals_[:1] for link, locals_ in self.ranks.take_stopped().items()}
        await self._every_rank("continue", lambda link, local: {"threadId": local}, only=targets)
        return {**reply, "success": True, "body": {**(reply.get("body") or {}), "allThreadsContinued": True}}

    async def _pause(self, msg: dict) -> dict:
        reply = await self.kernel.forward(msg)
        await self._every_rank("pause", lambda link, local: {"threadId": local}, main_only=True)
        return reply

    async def _setBreakpoints(self, msg: dict) -> dict:
        self.ranks.set_breakpoints[msg["arguments"]["source"]["path"]] = msg["arguments"]  # (a rank attached later)
        reply = await self.kernel.forward(msg)
        await self._every_rank("setBreakpoints", lambda link, local: msg["arguments"])
        return reply

    async def _setExceptionBreakpoints(self, msg: dict) -> dict:
        self.ranks.exception_filters = msg.get("arguments") or {}
        reply = await self.kernel.forward(msg)
        await self._every_rank("setExceptionBreakpoints", lambda link, local: msg["arguments"])
        return reply

    async def _debugInfo(self, msg: dict) -> dict:
        """A page that comes back finds a stopped rank first (JupyterLab shows the first stopped thread)."""
        reply = await self.kernel.forward(msg)
        body = reply.get("body") or {}
        return {**reply,
                "body": {**body, "stoppedThreads": self.ranks.stopped_ids() + list(body.get("stoppedThreads", []))}}

    async def _disconnect(self, msg: dict) -> dict:
        """The debugger turned off: every rank let go (a stopped one runs on), then the kernel's. A rank's
        session is closed rather than sent ``disconnect``: the adapter takes a closed client as one that
        disconnected, and a ``disconnect`` crossing a rank's exit can leave debugpy's adapter (1.8) holding a
        lock, so that it never answers the kernel's own."""
        for pid in list(self.ranks.links):
            self.ranks.gone(pid, told=False)
        self.ranks.exception_filters = None
        self.ranks.set_breakpoints.clear()
        return await self.kernel.forward(msg)

    async def _every_rank(self, command: str, arguments, only=None, main_only=False) -> None:
        """``command`` in every rank's debugger: once per rank, or for each of its threads in ``only[link]``
        (``main_only``: its main thread)."""
        calls = []
        for link in list(self.ranks.links.values()):
            if main_only and not link.name_list():
                try:
                    await link.threads()
                except (DapError, asyncio.TimeoutError):
                    continue
            if only is not None:
                targets = only.get(link, [])
            elif main_only:
                targets = [local for local, name in link.name_list() if name == "MainThread"][:1]
            else:
                targets = [None]
            calls += [link.call(command, arguments(link, local)) for local in targets]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                self.kernel.log(f"nbddp: {command} in a rank's debugger: {result}")


ROUTED = {"threads", "continue", "pause", "setBreakpoints", "setExceptionBreakpoints", "debugInfo", "disconnect"}


def _event(kind: str, **body) -> dict:
    return {"seq": 0, "type": "event", "event": kind, "body": body}


def _reply(msg: dict, success: bool = True, body: dict | None = None, message: str | None = None) -> dict:
    reply = {"seq": msg.get("seq"), "type": "response", "request_seq": msg.get("seq"), "success": success,
             "command": msg.get("command"), "body": body or {}}
    if message:
        reply["message"] = message
    return reply


_ranks: list = []  # the kernel's RankDebugger, once nbddp is in front of the kernel's debugger


def install(shell) -> str | None:
    """JupyterLab's debugger panel reaches the ranks too (at %load_ext); a line to say if it cannot."""
    kernel = getattr(shell, "kernel", None)
    if getattr(kernel, "debugger", None) is not None:
        why = debugpanel.unsupported()  # (what the ranks need of pydevd, checked once: ranks forked inherit it)
        if why:
            kernel.log.warning(why)
            return why

    def make(side):
        ranks = RankDebugger(side)
        _ranks[:] = [ranks]
        return Router(ranks, side).process, ranks.on_kernel_event

    return debugger.hook(shell, make)


def uninstall() -> None:
    """%unload_ext: the kernel's debugger as it was, every rank's session closed (a stopped rank runs on)."""
    debugger.unhook()
    for ranks in _ranks:
        for pid in list(ranks.links):
            ranks.gone(pid, told=False)
    _ranks.clear()


def stopped_s(pids) -> float:
    """Seconds the ranks ``pids`` stood stopped in the debugger panel, the longest stopped's (a cell's --timeout
    moves on by them)."""
    return _ranks[0].stopped_s(pids) if _ranks and _ranks[0].clocks else 0.0


def stopped_pids() -> frozenset:
    """The pids of the ranks stopped in the debugger panel now (their dashboard says so)."""
    return _ranks[0].stopped_pids() if _ranks else frozenset()


def renumbered(ranks: dict) -> None:
    """The pool's ranks moved (``Gang.on_Moved``): ``ranks`` is pid -> its rank now."""
    if _ranks:
        _ranks[0].renumbered(ranks)


def rank_started(pid: int, rank: int) -> None:
    """A rank the kernel just started (called where it forked or spawned it): the panel names its threads."""
    if _ranks:
        _ranks[0].rank_started(pid, rank, debugger.notebook_frames())
