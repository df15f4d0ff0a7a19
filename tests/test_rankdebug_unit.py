"""kernel/debugger/rankdebug.py's routing and its view of which rank threads are stopped, with fake rank sessions and a
fake kernel debugger (no kernel, no debugpy session): ids renumbered per rank, a rank thread's continue vs
thread 1's, a stop that comes while a continue is on its way kept, rank/debugpanel.py's gate on pydevd."""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading

import pytest

from nbddp.kernel.debugger import rankdebug
from nbddp.kernel.debugger.rankdebug import FIRST_ID, Ids, RankDebugger, RankLink, Router
from nbddp.rank import debugpanel


class FakeSession:
    """A rank's debugger session: every request answered at once (``answer(command, arguments)``, or success),
    what was sent kept; ``on_send`` runs before the answer (a reader thread's event meanwhile)."""

    def __init__(self, answer=None, on_send=None):
        self.sent, self.answer, self.on_send, self.closed = [], answer, on_send, False

    def send(self, command, arguments=None):
        self.sent.append((command, dict(arguments or {})))
        if self.on_send is not None:
            self.on_send(command, arguments or {})
        body = self.answer(command, arguments or {}) if self.answer else {}
        future = concurrent.futures.Future()
        if body is None:  # never answered
            return future
        future.set_result({"type": "response", "command": command, "success": True, "body": body})
        return future

    def request(self, command, arguments=None, timeout=10.0):
        return self.send(command, arguments).result(timeout)

    def close(self):
        self.closed = True


class FakeKernel:
    """ipy/debugger.py's KernelSide: what the kernel's own debugger was asked, what was published."""

    def __init__(self, stopped=False):
        self.forwarded, self.published, self.logged, self.is_stopped = [], [], [], stopped

    async def forward(self, msg):
        self.forwarded.append(msg)
        return {"seq": msg.get("seq"), "type": "response", "request_seq": msg.get("seq"), "success": True,
                "command": msg.get("command"), "body": {}}

    def publish(self, event):
        self.published.append(event)

    def breakpoints(self):
        return {}

    def accept_variable(self, name):
        return True

    def stopped(self):
        return self.is_stopped

    def log(self, text):
        self.logged.append(text)


def make(n_ranks=2, kernel_stopped=False, **session_args):
    kernel = FakeKernel(kernel_stopped)
    ranks = RankDebugger(kernel)
    links = []
    for rank in range(n_ranks):
        link = RankLink(1000 + rank, rank, FakeSession(**session_args), lock=ranks.lock)
        link.names[7] = "MainThread"
        ranks.links[link.pid] = link
        links.append(link)
    return kernel, ranks, Router(ranks, kernel), links


def stop(ranks, link, local=7, reason="breakpoint"):
    """The rank's reader thread: its debugger said the thread stopped."""
    ranks._rank_event(link, {"type": "event", "event": "stopped", "body": {"threadId": local, "reason": reason}})


def went_on(ranks, link, local=7):
    """pydevd's `continued` (it says it after a continue the panel asked for too, every thread of the rank)."""
    ranks._rank_event(link,
                      {"type": "event", "event": "continued", "body": {"threadId": local, "allThreadsContinued": True}})


def request(router, command, **arguments):
    return asyncio.run(router.process({"seq": 5, "type": "request", "command": command, "arguments": arguments}))


def events(kernel, kind):
    return [e["body"] for e in kernel.published if e["event"] == kind]


@pytest.mark.unit
def test_ids_are_per_rank_session_far_from_the_kernels_and_forgotten_with_it():
    counter = iter(range(FIRST_ID, FIRST_ID + 100))
    threads, frames = Ids(counter), Ids(counter)
    a, b = object(), object()
    ta, tb, fa = threads.out(a, 7), threads.out(b, 7), frames.out(a, 7)
    assert len({ta, tb, fa}) == 3 and min(ta, tb, fa) >= FIRST_ID
    assert threads.out(a, 7) == ta and threads.back(ta) == (a, 7) and threads.back(tb) == (b, 7)
    assert threads.back(1) is None and threads.back("7") is None and threads.back(None) is None
    threads.forget(a)
    assert threads.back(ta) is None and threads.back(tb) == (b, 7)


@pytest.mark.unit
def test_the_owner_of_a_request_is_the_rank_whose_id_it_carries():
    _kernel, ranks, router, (r0, r1) = make()
    t1, f0, v1 = ranks.threads.out(r1, 7), ranks.frames.out(r0, 3), ranks.refs.out(r1, 9)
    assert router._owner({"threadId": t1}) == (r1, {"threadId": 7})
    assert router._owner({"frameId": f0}) == (r0, {"frameId": 3})
    assert router._owner({"variablesReference": v1}) == (r1, {"variablesReference": 9})
    assert router._owner({"srcFrameId": f0, "dstVariableName": "x"}) == (r0, {"srcFrameId": 3})
    assert router._owner({"threadId": 1}) is None  # the kernel's own thread
    assert router._owner({"frameId": 140000000000, "variablesReference": 3}) is None  # the kernel's own ids
    assert router._owner({}) is None


@pytest.mark.unit
def test_a_rank_threads_continue_goes_to_that_rank_alone_and_it_is_no_longer_stopped_before_it_is_sent():
    kernel, ranks, router, (r0, r1) = make()
    seen_stopped = []
    r0.session.on_send = lambda command, args: seen_stopped.append(set(r0.stopped))
    r0.session.answer = lambda command, args: {"allThreadsContinued": True}
    stop(ranks, r0)
    stop(ranks, r1)
    assert ranks.stopped_pids() == {r0.pid, r1.pid}
    reply = request(router, "continue", threadId=ranks.threads.out(r0, 7))
    assert reply["success"] and reply["request_seq"] == 5 and reply["command"] == "continue", reply
    assert r0.session.sent == [("continue", {"threadId": 7})] and r1.session.sent == []
    assert seen_stopped == [set()]  # taken out before the rank was asked: a stop it says now is a new one
    assert ranks.stopped() == [(r1, 7)] and ranks.stopped_pids() == {r1.pid}
    assert kernel.forwarded == []


@pytest.mark.unit
def test_a_continue_of_a_rank_whose_threads_run_is_answered_without_asking_the_rank():
    """pydevd answers a continue of a thread that runs only after the thread's next stop goes on: a stop
    said again that crossed the user's continue must not hold the panel up."""
    _kernel, ranks, router, (r0, _r1) = make()
    reply = request(router, "continue", threadId=ranks.threads.out(r0, 7))
    assert reply["success"] and reply["body"] == {"allThreadsContinued": False}, reply
    assert r0.session.sent == []
    stop(ranks, r0)  # a step of a thread that runs fails at once, one that is stopped goes to the rank
    assert not request(router, "next", threadId=ranks.threads.out(r0, 8))["success"]
    assert request(router, "next", threadId=ranks.threads.out(r0, 7))["success"]
    assert r0.session.sent == [("next", {"threadId": 7})] and ranks.stopped() == []


@pytest.mark.unit
def test_a_continue_the_rank_never_answers_leaves_its_thread_stopped():
    _kernel, ranks, router, (r0, _r1) = make(answer=lambda command, args: None)
    rankdebug_timeout, rankdebug.CALL_TIMEOUT_S = rankdebug.CALL_TIMEOUT_S, 0.2
    try:
        stop(ranks, r0)
        reply = request(router, "continue", threadId=ranks.threads.out(r0, 7))
    finally:
        rankdebug.CALL_TIMEOUT_S = rankdebug_timeout
    assert not reply["success"] and reply["message"] == "rank 0: no answer within 0.2 s", reply
    assert ranks.stopped() == [(r0, 7)]


@pytest.mark.unit
def test_continue_of_thread_1_lets_the_kernel_and_every_stopped_rank_go_once():
    kernel, ranks, router, (r0, r1) = make(kernel_stopped=True)
    stop(ranks, r0)
    stop(ranks, r0, 8)
    reply = request(router, "continue", threadId=1)
    assert reply["success"] and reply["body"]["allThreadsContinued"] is True
    assert [m["command"] for m in kernel.forwarded] == ["continue"]
    assert r0.session.sent == [("continue", {"threadId": 7})]  # once: a continue lets all its threads go
    assert r1.session.sent == []  # it runs
    assert ranks.stopped() == [] and ranks.stopped_pids() == frozenset()
    kernel.is_stopped = False
    request(router, "continue", threadId=1)
    assert len(kernel.forwarded) == 1  # the kernel's debugger leaves a continue of a thread that runs unanswered


@pytest.mark.unit
@pytest.mark.parametrize("command", ["continue-rank", "continue-all"])
def test_a_stop_that_comes_while_a_continue_is_on_its_way_is_kept_and_said(command):
    kernel, ranks, router, (r0, r1) = make()

    def meanwhile(sent_command, args):  # the other rank's reader: a stop, while the continue is sent
        if sent_command == "continue":
            stop(ranks, r1)

    r0.session.on_send = meanwhile
    stop(ranks, r0)
    request(router, "continue", threadId=ranks.threads.out(r0, 7) if command == "continue-rank" else 1)
    assert ranks.stopped() == [(r1, 7)] and ranks.stopped_pids() == {r1.pid}
    assert ranks.threads.out(r1, 7) in [b["threadId"] for b in events(kernel, "stopped")]
    assert ranks.stopped_s([r1.pid]) >= 0.0 and ranks.clocks[r1.pid][1] is not None  # its clock runs
    request(router, "continue", threadId=ranks.threads.out(r1, 7))  # and it is let go when asked
    assert r1.session.sent == [("continue", {"threadId": 7})] and ranks.stopped() == []


@pytest.mark.unit
def test_stops_from_reader_threads_are_never_lost_to_continues_on_the_control_thread():
    """Each rank a thread that stops, waits to be let go, goes on, stops again (pydevd's events on its reader
    thread) while the control thread continues thread 1 over and over: every stop is let go."""
    _kernel, ranks, router, links = make(n_ranks=3)
    rounds, lost, finished = 300, [], []
    switch, _ = sys.getswitchinterval(), sys.setswitchinterval(1e-6)  # threads switch as often as can be
    let_go = {link: threading.Semaphore(0) for link in links}
    for link in links:
        link.session.on_send = lambda command, args, link=link: command == "continue" and let_go[link].release()

    def rank(link):
        for _ in range(rounds):
            stop(ranks, link)
            if not let_go[link].acquire(timeout=5):
                lost.append(link.rank)
                return
            went_on(ranks, link)
        finished.append(link.rank)

    threads = [threading.Thread(target=rank, args=(link,), daemon=True) for link in links]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            request(router, "continue", threadId=1)
    finally:
        sys.setswitchinterval(switch)
    assert not lost and sorted(finished) == [0, 1, 2]
    assert ranks.stopped() == [] and all(len(link.session.sent) == rounds for link in links)


@pytest.mark.unit
def test_a_continued_rank_says_so_and_a_rank_still_stopped_is_said_again_as_such():
    kernel, ranks, router, (r0, r1) = make()
    stop(ranks, r0)
    stop(ranks, r1)
    request(router, "continue", threadId=ranks.threads.out(r0, 7))
    went_on(ranks, r0)
    assert events(kernel, "continued")[-1]["threadId"] == ranks.threads.out(r0, 7)
    again = events(kernel, "stopped")[-1]
    assert again["threadId"] == ranks.threads.out(r1, 7) and again["stillStopped"] is True
    assert ranks.stopped() == [(r1, 7)]
    request(router, "continue", threadId=ranks.threads.out(r1, 7))
    went_on(ranks, r1)
    assert len(events(kernel, "stopped")) == 3  # two stops, one said again: none after the last went on


@pytest.mark.unit
def test_a_pause_where_no_cell_is_runs_on_unseen_and_one_in_a_cell_is_said(monkeypatch):
    monkeypatch.setattr(rankdebug.debugger, "cell_prefix", lambda: "/tmp/ipykernel_1/")
    frames = {7: [{"id": 1, "source": {"path": "/nbddp/rank/server.py"}, "line": 3}],
              8: [{"id": 2, "source": {"path": "/tmp/ipykernel_1/123.py"}, "line": 4}]}
    kernel, ranks, _router, (r0, _r1) = make(answer=lambda command, args: {"stackFrames": frames[args["threadId"]]}
                                            if command == "stackTrace" else {})
    for local in (7, 8):
        ranks._paused(r0, {"type": "event", "event": "stopped", "body": {"threadId": local, "reason": "pause"}})
    assert ("continue", {"threadId": 7}) in r0.session.sent and r0.quiet == {7}
    assert ranks.stopped() == [(r0, 8)] and [b["threadId"]
                                             for b in events(kernel, "stopped")] == [ranks.threads.out(r0, 8)]
    ranks._rank_event(r0,
                      {"type": "event", "event": "continued", "body": {"threadId": 7, "allThreadsContinued": False}})
    assert events(kernel, "continued") == [] and r0.quiet == set()  # its continued unsaid too


@pytest.mark.unit
def test_a_pause_pydevd_says_on_another_thread_is_said_on_the_one_in_the_cell(monkeypatch):
    """debugpy 1.8.15 (ipykernel 6.17's) may name, for a pause that stopped every thread, a thread of nbddp's (its
    stack empty): the rank's thread in the cell is said stopped, not let go (the panel's "pause all" lost rank 0
    now and then); a pause with no thread in a cell lets every thread go, their `continued` unsaid, whichever named."""
    monkeypatch.setattr(rankdebug.debugger, "cell_prefix", lambda: "/tmp/ipykernel_1/")
    frames = {5: [], 4: [{"id": 2, "source": {"path": "/tmp/ipykernel_1/123.py"}, "line": 5}]}
    answer = {"stackTrace": lambda args: {"stackFrames": frames[args["threadId"]]},
              "threads": lambda args: {"threads": [{"id": 4, "name": "MainThread"}, {"id": 5, "name": "nbddp-flush"}]}}
    kernel, ranks, _router, (r0, r1) = make(answer=lambda command, args: answer.get(command, lambda a: {})(args))
    paused = {"type": "event", "event": "stopped",
              "body": {"threadId": 5, "reason": "pause", "allThreadsStopped": True}}
    ranks._paused(r0, paused)
    assert ranks.stopped() == [(r0, 4)] and ("continue", {"threadId": 5}) not in r0.session.sent
    assert [b["threadId"] for b in events(kernel, "stopped")] == [ranks.threads.out(r0, 4)]
    frames[4] = [{"id": 3, "source": {"path": "/nbddp/rank/server.py"}, "line": 3}]  # waiting in nbddp: let go
    ranks._paused(r1, paused)
    assert ("continue", {"threadId": 5}) in r1.session.sent and r1.quiet == {4, 5}
    went_on(ranks, r1, local=4)  # (pydevd names the main thread in its `continued`)
    assert events(kernel, "continued") == [] and r1.quiet == set() and ranks.stopped() == [(r0, 4)]


@pytest.mark.unit
def test_a_rank_gone_says_its_stopped_threads_went_on_and_its_late_events_are_dropped():
    kernel, ranks, _router, (r0, r1) = make()
    stop(ranks, r0)
    stop(ranks, r1)
    ids = ranks.threads.out(r0, 7)
    ranks.gone(r0.pid)
    assert r0.session.closed and ranks.stopped() == [(r1, 7)]
    assert events(kernel, "continued") == [{"threadId": ids, "allThreadsContinued": False}]
    assert events(kernel, "stopped")[-1]["stillStopped"] is True
    published = len(kernel.published)
    stop(ranks, r0)  # its reader's last event, after it was let go
    assert len(kernel.published) == published and ranks.threads.back(ids) is None


@pytest.mark.unit
def test_ranks_renumbered_by_a_shrink_are_named_by_their_new_numbers_in_the_panel():
    _kernel, ranks, router, (r0, r1) = make(
        answer=lambda command, _args: {"threads": [{"id": 7, "name": "MainThread"}]} if command == "threads" else {})
    ranks.rank_started(r1.pid, 1, {("cell.py", 3)})
    ranks.gone(r0.pid)
    ranks.renumbered({r1.pid: 0, 4242: 1})  # (a pid the panel never saw: nothing to rename)
    assert r1.label == "rank 0" and ranks.ranks[r1.pid] == (0, frozenset({("cell.py", 3)})) and 4242 not in ranks.ranks
    reply = request(router, "threads")
    assert [t["name"] for t in reply["body"]["threads"]] == ["rank 0 · MainThread"], reply
    rankdebug._ranks[:] = []
    rankdebug.renumbered({r1.pid: 1})  # no panel in this kernel: nothing to do
    assert r1.label == "rank 0"


@pytest.mark.unit
def test_without_pydevds_private_parts_ranks_start_as_without_the_panel(monkeypatch):
    why = "nbddp: the debugger panel cannot reach the ranks with debugpy 9: its pydevd has no pydevd_tracing"
    monkeypatch.setattr(debugpanel, "_gate", [(None, why)])
    monkeypatch.setitem(__import__("sys").modules, "pydevd", object())  # (the kernel's, inherited by a fork)
    debugpanel.after_fork()  # nothing of pydevd touched, no error
    debugpanel.before_cell({"host": "127.0.0.1", "port": 1})  # no connect attempt
    debugpanel.before_cell(None)
    assert debugpanel._debugger() is None and debugpanel.unsupported() == why

    class Log:
        def __init__(self):
            self.lines = []

        def warning(self, text):
            self.lines.append(text)

    shell = type("Shell", (), {})()
    shell.kernel = type("Kernel", (), {"debugger": object(), "log": Log()})()
    assert rankdebug.install(shell) == why and shell.kernel.log.lines == [why]


def test_the_gate_names_what_this_debugpy_lacks(monkeypatch):
    pytest.importorskip("debugpy")
    monkeypatch.setattr(debugpanel, "REQUIRED",
                        (*debugpanel.REQUIRED, ("pydevd_tracing", ("renamed_in_2030",), "the future")))
    parts, why = debugpanel._check()
    assert parts is None and "its pydevd has no pydevd_tracing.renamed_in_2030 (the future)" in why, why
    monkeypatch.setattr(debugpanel, "REQUIRED", debugpanel.REQUIRED[:-1])
    parts, why = debugpanel._check()
    assert why is None and callable(parts.settrace) and callable(parts.undo_patch_thread_modules)
