"""JupyterLab's debugger panel in the ranks, through real kernels: the debug protocol on the control channel
as JupyterLab speaks it (debugclient.py), real forked ranks, real debugpy. A breakpoint in a ``%%ddp`` cell
stops every rank; each rank is threads named by it; frames, variables, evaluate are the rank's; continue,
next act on the rank or on all; detach lets stopped ranks go; nothing is left when the ranks end."""
from __future__ import annotations

import os
import re
import time
from collections import Counter

import psutil
import pytest

from debugclient import DebugClient, is_new_stop
from kernel import Kernel, said

pytestmark = pytest.mark.timeout(240)

ONE_SHOT = """%%ddp --devices 2
import os
x = 41 + rank
y = x * 2
print('done', rank, y)
"""


@pytest.fixture
def kernel():
    with Kernel() as k:
        k.ok("%load_ext nbddp")
        yield k


def rank_of(thread_name: str) -> int:
    return int(thread_name.split()[1])


def stopped_at_line_4(kernel, options: str = "", timeout: float = 60):
    """The panel on, a breakpoint at ONE_SHOT's line 4 (`y = x * 2`), the cell sent with ``options``, both
    ranks stopped there: (the panel, the cell's request id, the stopped events' bodies)."""
    panel = DebugClient(kernel)
    panel.start()
    cell = ONE_SHOT.replace("--devices 2", f"--devices 2 {options}".rstrip())
    panel.breakpoints(cell, [4])
    msg_id = kernel.execute(cell)
    return panel, msg_id, panel.stopped(2, timeout=timeout)


def test_a_breakpoint_in_a_one_shot_cell_stops_every_rank_with_its_own_frames_and_variables(kernel):
    panel = DebugClient(kernel)
    info = panel.start()
    path = panel.breakpoints(ONE_SHOT, [4])  # `y = x * 2`: line 4 of the cell, the %%ddp line counting
    assert path.startswith(info["tmpFilePrefix"])
    msg_id = kernel.execute(ONE_SHOT)
    stops = panel.stopped(2)
    threads = panel.threads()
    ranks = {name: tid for name, tid in threads.items() if name.startswith("rank ")}
    assert set(ranks) == {"rank 0 · MainThread", "rank 1 · MainThread"}, threads
    assert "MainThread" in threads  # the kernel's own, beside them
    assert {s["threadId"] for s in stops} == set(ranks.values())
    for name, tid in ranks.items():
        frames = panel.frames(tid, startFrame=0, levels=20)  # one thread's own (a client that pages)
        assert [f["line"] for f in frames] == [4], frames
        assert frames[0]["source"]["path"] == path  # the cell JupyterLab dumped: its line is highlighted there
        assert frames[0]["name"] == f"{name} · <module>"
        local = panel.variables(frames[0]["id"])
        assert local["rank"] == str(rank_of(name)) and local["x"] == str(41 + rank_of(name)), local
        assert "y" not in local  # stopped before line 4 ran
        value = panel.ok("evaluate", {"expression": "x * 1000", "frameId": frames[0]["id"], "context": "repl"})
        assert value["result"] == str((41 + rank_of(name)) * 1000)
        rich = panel.ok("richInspectVariables", {"variableName": "x", "frameId": frames[0]["id"]})
        assert rich["data"]["text/plain"] == str(41 + rank_of(name))
    # the cell's dashboard says where they are, at its next tick
    kernel.follow(msg_id, lambda r: any(re.search(r"\n0 +in debugger .*\n1 +in debugger", d["data"]["text/plain"])
                                        for d in r.displays if "text/plain" in d.get("data", {})), timeout=30)
    # JupyterLab asks the last stopped thread's stack without `levels`: every stopped rank's frames
    shown = panel.frames(stops[-1]["threadId"])
    assert sorted(f["name"] for f in shown) == ["rank 0 · MainThread · <module>", "rank 1 · MainThread · <module>"]
    info = panel.ok("debugInfo")
    assert set(ranks.values()) <= set(info["stoppedThreads"])
    panel.ok("continue", {"threadId": 1})  # JupyterLab's Continue button: thread 1, every rank goes on
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is None and said(res.stdout, 0, "done 0 82") and said(res.stdout, 1, "done 1 84"), res.stdout
    panel.stop()


POOL_CELL = """%%ddp
total = 0
for step in range(3):
    total += step + rank
print('total', rank, total)
"""


def both_ranks_stopped(panel, since: int) -> list[int]:
    """Until both ranks' threads, as the panel lists them now, stopped after event ``since``: their ids."""
    live = []

    def done(events):
        live[:] = [tid for name, tid in panel.threads().items() if name.startswith("rank ")]
        return len(live) == 2 and set(live) <= {e["body"]["threadId"] for e in events[since:] if is_new_stop(e)}

    panel.pump(done, 60, "both ranks stopped")
    return live


def test_a_pool_attached_mid_life_steps_one_rank_continues_them_all_and_lets_go_when_detached(kernel):
    kernel.ok("%ddp start --devices 2")
    kernel.ok("%%ddp\nwarm = rank")  # the pool ran before the debugger was on
    panel = DebugClient(kernel)
    panel.start()
    panel.breakpoints(POOL_CELL, [4])  # `total += step + rank`
    msg_id = kernel.execute(POOL_CELL)
    stops = panel.stopped(2)
    names = {tid: name for name, tid in panel.threads().items()}
    rank0 = next(s["threadId"] for s in stops if names[s["threadId"]] == "rank 0 · MainThread")
    rank1 = next(s["threadId"] for s in stops if names[s["threadId"]] == "rank 1 · MainThread")
    # `next` on rank 0 only: it goes round the loop once and stops again at line 4, rank 1 stays where it was
    seen = len(panel.events)
    panel.ok("next", {"threadId": rank0})
    panel.stopped(1, since=seen)
    frame0 = panel.frames(rank0, levels=20)[0]
    assert frame0["line"] == 3 or frame0["line"] == 4, frame0
    seen = len(panel.events)
    panel.ok("next", {"threadId": rank0})
    panel.stopped(1, since=seen)
    v0 = panel.variables(panel.frames(rank0, levels=20)[0]["id"], "Globals")
    v1 = panel.variables(panel.frames(rank1, levels=20)[0]["id"], "Globals")
    assert v0["total"] == "0" and v0["step"] == "1", v0  # rank 0 went one step on
    assert v1["step"] == "0" and v1["total"] == "0", v1  # rank 1 did not
    # continue one rank (a client that names the thread): the other stays stopped
    panel.ok("continue", {"threadId": rank1})
    seen = len(panel.events)
    stops = panel.stopped(1, since=seen)  # rank 1 hits line 4 again
    assert stops[0]["threadId"] == rank1
    # the debugger turned off while both are stopped: both run on to the end, no breakpoint any more
    panel.stop()
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is None and said(res.stdout, 0, "total 0 3") and said(res.stdout, 1, "total 1 6"), res.stdout
    # the next cell runs as without the debugger
    assert said(kernel.ok("%%ddp\nprint('again', rank)").stdout, 1, "again 1")
    # turned on again: the same ranks stop again
    panel = DebugClient(kernel)
    panel.start()
    panel.breakpoints(POOL_CELL, [4])
    msg_id = kernel.execute(POOL_CELL)
    live = both_ranks_stopped(panel, since=0)  # (events the first client left unread are the old sessions')
    frame = panel.frames(live[0], levels=20)[0]  # the new sessions answer (ids are per session)
    assert frame["line"] == 4 and panel.variables(frame["id"], "Globals")["step"] == "0", frame
    seen = len(panel.events)
    panel.ok("continue", {"threadId": 1})
    both_ranks_stopped(panel, since=seen)  # the loop's next round
    panel.ok("setBreakpoints", {"source": {"path": panel.ok("dumpCell", {"code": POOL_CELL})["sourcePath"]},
                                "breakpoints": [], "sourceModified": False})
    panel.ok("continue", {"threadId": 1})
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is None and said(res.stdout, 1, "total 1 6"), res.stdout
    pids = [p.pid for p in kernel.process().children() if p.name().startswith("python")]
    kernel.ok("%ddp stop")
    # nothing is left: the ranks' sessions end with them (the panel lists the kernel's threads only)
    panel.pump(lambda _: not [n for n in panel.threads() if n.startswith("rank ")], 30, "the ranks' threads gone")
    panel.stop()
    names = kernel.value("sorted(t.name for t in __import__('threading').enumerate())")
    assert not [n for n in names if n.startswith(("nbddp-dap", "nbddp-debug"))], names
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_breakpoint_call_stops_in_the_panel_while_it_is_on_and_is_pdb_otherwise(kernel):
    panel = DebugClient(kernel)
    panel.start()
    msg_id = kernel.execute("%%ddp --devices 2\nz = rank * 10\nbreakpoint()\nprint('after', rank, z)\n")
    stops = panel.stopped(2)
    names = {tid: name for name, tid in panel.threads().items()}
    for stop in stops:
        frame = panel.frames(stop["threadId"], levels=20)[0]
        assert frame["line"] == 3, frame
        assert panel.variables(frame["id"])["z"] == str(10 * rank_of(names[stop["threadId"]]))
    panel.ok("continue", {"threadId": 1})
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is None and said(res.stdout, 1, "after 1 10"), res.stdout
    panel.stop()
    # off: breakpoint() is pdb in the notebook's input box, as before (answered with `c`)
    res = kernel.converse("%%ddp --devices 2\nbreakpoint()\nprint('went on', rank)\n", lambda prompt: "c")
    assert res.error is None and res.prompts and said(res.stdout, 1, "went on 1"), (res.prompts, res.stdout)


TRACED = """%%ddp --devices 2
import sys
monitoring = getattr(sys, 'monitoring', None)  # (pydevd's way on Python 3.12+)
print('traced', rank, sys.gettrace() is not None or bool(monitoring and monitoring.get_tool(monitoring.DEBUGGER_ID)))
"""


def test_without_the_panel_ranks_run_untraced_before_and_after_it_was_on(kernel):
    res = kernel.ok(TRACED)
    assert said(res.stdout, 0, "traced 0 False") and said(res.stdout, 1, "traced 1 False"), res.stdout
    panel = DebugClient(kernel)
    panel.start()
    res = kernel.ok(TRACED)
    assert said(res.stdout, 0, "traced 0 True") and said(res.stdout, 1, "traced 1 True"), res.stdout
    panel.stop()
    # the kernel's debugger started once (debugpy stays in the kernel, tracing it): ranks forked now let go
    # of what they inherited of it (debugpanel.after_fork)
    res = kernel.ok(TRACED)
    assert said(res.stdout, 0, "traced 0 False") and said(res.stdout, 1, "traced 1 False"), res.stdout


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_and_forkserver_ranks_connect_at_their_cell_and_stop_too(kernel, method):
    panel, msg_id, stops = stopped_at_line_4(kernel, f"--start-method {method}", timeout=120)
    names = {tid: name for name, tid in panel.threads().items()}
    for stop in stops:
        frame = panel.frames(stop["threadId"], levels=20)[0]
        assert frame["line"] == 4 and frame["name"].startswith(names[stop["threadId"]]), frame
        assert panel.variables(frame["id"])["x"] == str(41 + rank_of(names[stop["threadId"]]))
    panel.ok("continue", {"threadId": 1})
    res = kernel.collect(msg_id, timeout=120)
    assert res.error is None and said(res.stdout, 1, "done 1 84"), res.stdout
    panel.stop()


@pytest.mark.unit
def test_an_ipykernel_whose_debugger_lacks_what_nbddp_reads_is_named_in_the_warning():
    from nbddp.ipy import debugger

    class Debugger:  # an ipykernel of the future: no breakpoint_list
        process_request = event_callback = stopped_threads = accept_variable = is_started = None
        debugpy_client = type("Client", (), {"event_callback": None})()

    why = debugger.unsupported(Debugger())
    assert "has no breakpoint_list (the breakpoints set)" in why and "pdb works in the ranks" in why, why
    assert debugger.unsupported(type("Full", (Debugger,), {"breakpoint_list": {}})()) is None


SPIN = """%%ddp --devices 2
import time
done = False
print('spinning', rank, flush=True)
while not done:
    time.sleep(0.02)
print('out', rank)
"""


@pytest.mark.serial  # on a loaded machine (two workers), the Colab-like stack once lost rank 0's pause
def test_pause_acts_on_the_rank_named_or_on_every_rank_and_evaluate_changes_a_rank_state(kernel):
    panel = DebugClient(kernel)
    panel.start()
    msg_id = kernel.execute(SPIN)
    threads = {}

    def attached(_events):
        threads.update(panel.threads())
        return {"rank 0 · MainThread", "rank 1 · MainThread"} <= set(threads)

    panel.pump(attached, 60, "both ranks attached")
    kernel.follow(msg_id, lambda r: said(r.stdout, 0, "spinning 0") and said(r.stdout, 1, "spinning 1"), timeout=60)
    rank1 = threads["rank 1 · MainThread"]
    panel.ok("pause", {"threadId": rank1})  # a client that names a rank's thread: that rank alone
    stop = panel.stopped(1)[0]
    assert stop["threadId"] == rank1 and stop["reason"] == "pause", stop
    frames = panel.frames(rank1, levels=20)
    assert frames[0]["line"] in (5, 6), [(f["name"], f["source"].get("path"), f["line"]) for f in frames]  # in its loop
    frame = frames[0]
    panel.ok("evaluate", {"expression": "globals().update(done=True)", "frameId": frame["id"], "context": "repl"})
    panel.ok("continue", {"threadId": rank1})
    res = kernel.follow(msg_id, lambda r: said(r.stdout, 1, "out 1"), timeout=30)  # rank 1 went on, out of its loop
    assert not said(res.stdout, 0, "out 0")  # rank 0 was never stopped, and still spins
    seen = len(panel.events)
    panel.ok("pause", {"threadId": 1})  # JupyterLab's Pause: the kernel and every rank
    rank0 = threads["rank 0 · MainThread"]

    def paused(events):  # the kernel's main thread and rank 0's (rank 1 waits in nbddp, out of the user's code)
        return {1, rank0} <= {e["body"]["threadId"] for e in events[seen:] if e["event"] == "stopped"}

    panel.pump(paused, 60, "the kernel and rank 0 paused")
    frame = panel.frames(rank0, levels=20)[0]
    panel.ok("evaluate", {"expression": "globals().update(done=True)", "frameId": frame["id"], "context": "repl"})
    panel.ok("continue", {"threadId": 1})  # JupyterLab's Continue: all
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is None, res.error_text
    panel.stop()


def test_timeout_moves_on_by_the_time_ranks_stand_stopped_in_the_panel(kernel):
    import time

    panel, msg_id, _ = stopped_at_line_4(kernel, "--timeout 6")
    time.sleep(8)  # stopped, on purpose, past --timeout: the user reading the panel
    panel.ok("continue", {"threadId": 1})
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is None and said(res.stdout, 1, "done 1 84"), (res.error_text, res.stdout)
    panel.stop()


def test_a_cell_run_before_the_panel_was_on_stops_at_its_breakpoint_when_run_again(kernel):
    # turning the panel on, ipykernel runs `debugpy.listen` as a silent cell cached under the next cell's number;
    # the cell run again with the panel on was run by its ranks under that cell's file, not its own: no stop
    assert said(kernel.ok(ONE_SHOT).stdout, 1, "done 1 84")
    panel, msg_id, stops = stopped_at_line_4(kernel)
    path = panel.ok("dumpCell", {"code": ONE_SHOT})["sourcePath"]
    for stop in stops:
        frame = panel.frames(stop["threadId"], levels=20)[0]
        assert frame["line"] == 4 and frame["source"]["path"] == path, frame
    panel.ok("continue", {"threadId": 1})
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is None and said(res.stdout, 0, "done 0 82"), res.stdout
    panel.stop()


@pytest.mark.unit
def test_the_kernels_debugger_neither_traces_nor_lists_the_thread_warming_imports(monkeypatch):
    # traced (the panel turned on right after %load_ext), its imports took 7.5 s instead of 1.3 on 2 cores, and
    # the first cell's forks wait for it on --timeout's clock (test_timeout_moves_on...: rank 1 never forked)
    from nbddp.kernel.ranks import warm

    monkeypatch.delenv("NBDDP_WARM", raising=False)
    monkeypatch.setattr(warm, "WARM_IMPORTS", ("nbddp_test_no_such_module",))  # (its failure is swallowed)
    monkeypatch.setattr(warm.WARMING, "thread", None)
    warm.start()
    thread = warm.WARMING.thread
    assert thread is not None and thread.pydev_do_not_trace and thread.is_pydev_daemon_thread
    warm.wait()


@pytest.mark.parametrize("options", ["--bg", "--bg --start-method forkserver"])
def test_a_background_cell_stops_in_the_panel_while_the_notebook_runs_other_cells(kernel, options):
    panel, msg_id, stops = stopped_at_line_4(kernel, options, timeout=120)
    assert kernel.collect(msg_id, timeout=30).status == "ok"  # the cell's reply: the notebook was free at once
    assert kernel.ok("6 * 7").result == "42"  # a plain cell while the ranks stand stopped
    names = {tid: name for name, tid in panel.threads().items()}
    assert {names.get(s["threadId"]) for s in stops} == {"rank 0 · MainThread", "rank 1 · MainThread"}, names
    frame = panel.frames(stops[0]["threadId"], levels=20)[0]
    assert frame["line"] == 4 and "x" in panel.variables(frame["id"])
    panel.ok("continue", {"threadId": 1})
    res = kernel.follow(msg_id, lambda r: said(r.stdout, 0, "done 0 82") and said(r.stdout, 1, "done 1 84"), timeout=60)
    assert res.error is None
    panel.stop()


LOOP_CELL = """%%ddp
hits = 0
for i in range(10):
    hits += 1
print('loop', rank, hits)
"""
STRESS = int(os.environ.get("NBDDP_STRESS", "2"))  # how many times each pace runs (issue 51 asks for 20)


@pytest.fixture(scope="module")
def pool_kernel():
    with Kernel() as k:
        k.ok("%load_ext nbddp")
        k.ok("%ddp start --devices 2")
        yield k


def continue_every_stop(kernel, panel, msg_id: str, pace: float, timeout: float = 120) -> tuple[Counter, Counter, list]:
    """As JupyterLab's user does it: each rank thread's stop continued by its thread id (``pace`` seconds after
    it was seen), until the cell ends. A stop said again of a thread still stopped (``stillStopped``: the panel
    cleared its view at another thread's ``continued``) is no new stop. (stops, continues by thread, failed
    continue replies)."""
    stops, continues, failed = Counter(), Counter(), []
    waiting: set[int] = set()  # threads seen stopped, not continued yet
    seen = len(panel.events)
    deadline = time.monotonic() + timeout

    def ended(_events=None):
        return any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                   for m in kernel.stray.get(msg_id, []))

    while not ended():
        try:
            panel.pump(lambda events, seen=seen: len(events) > seen or ended(), max(0.1, deadline - time.monotonic()),
                       "a debug event")
        except TimeoutError as e:
            raise AssertionError(f"the cell never ended: stops {dict(stops)}, continues {dict(continues)}, "
                                 f"failed {failed}, waiting {waiting}: {e}") from None
        new, seen = panel.events[seen:], len(panel.events)
        for event in new:
            body = event.get("body") or {}
            if event["event"] == "stopped" and body.get("threadId", 0) >= 1 << 50 and not body.get("stillStopped"):
                assert body["threadId"] not in waiting, f"a second stop of a thread never continued: {event}"
                stops[body["threadId"]] += 1
                waiting.add(body["threadId"])
        for tid in sorted(waiting):
            time.sleep(pace)
            reply = panel.request("continue", {"threadId": tid})
            continues[tid] += 1
            waiting.discard(tid)
            if not reply.get("success"):
                failed.append(reply.get("message"))
    return stops, continues, failed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", range(STRESS))
@pytest.mark.parametrize("pace", [0.0, 0.5], ids=["at-once", "half-second"])
def test_a_breakpoint_in_a_pool_loop_stops_each_rank_ten_times_each_continued_by_its_thread(pool_kernel, pace, run):
    panel = DebugClient(pool_kernel)
    panel.start()
    msg_id = None
    try:
        panel.breakpoints(LOOP_CELL, [4])  # `hits += 1`: hit 10 times on each of 2 ranks
        start = time.monotonic()
        msg_id = pool_kernel.execute(LOOP_CELL)
        stops, continues, failed = continue_every_stop(pool_kernel, panel, msg_id, pace)
        res = pool_kernel.collect(msg_id, timeout=60)
        msg_id = None
        assert not failed and sorted(stops.values()) == [10, 10] and stops == continues, (stops, continues, failed)
        assert res.error is None and said(res.stdout, 0, "loop 0 10") and said(res.stdout, 1, "loop 1 10"), res.stdout
        print(f"pace {pace}: 20 stops, 20 continues, {time.monotonic() - start:.1f} s")
    finally:
        try:
            panel.request("disconnect", {"restart": False, "terminateDebuggee": False}, timeout=30)
        finally:
            if msg_id is not None:  # a run that failed: its ranks let go, the cell over, for the next run
                pool_kernel.collect(msg_id, timeout=60)
