"""Background cells (``%%ddp --bg``) through a real kernel: the notebook cell returns at once, its output
keeps arriving in that cell (messages whose parent is its request), plain cells run meanwhile, results land
between cells, interrupts touch only what they mean, a second client attaches (a reloaded page)."""
from __future__ import annotations

import re
import time

import psutil
import pytest

from kernel import Kernel, said

pytestmark = pytest.mark.timeout(240)

TRAIN = """%%ddp --bg {opts}
import time
for i in range({steps}):
    print('step', i, flush=True)
    time.sleep({pause})
{tail}"""


def pool_line_ended(res) -> bool:
    """The pool cell's own line in its final state (ok, failed, interrupted), or an error shown."""
    return res.error is not None or any(
        re.search(r"· (ok|failed|interrupted)", d.get("data", {}).get("text/plain", "")) for d in res.displays)


def bars_shown(res) -> bool:
    return any("-bars" in d.get("transient", {}).get("display_id", "") for d in res.displays)


def last_line(res) -> str:
    lines = [d["data"]["text/plain"] for d in res.displays if "nbddp pool ·" in d.get("data", {}).get("text/plain", "")]
    return lines[-1] if lines else ""


def send(kernel, code: str) -> str:
    """A background cell sent; its request's id, once its reply came (it must come at once)."""
    msg_id = kernel.execute(code)
    res = kernel.collect(msg_id, timeout=30)
    assert res.status == "ok" and res.error is None, res.error_text
    assert "background cell" in res.stderr, res.stderr
    return msg_id


def test_a_background_pool_cell_returns_at_once_and_its_output_keeps_arriving_in_its_cell(pool):
    t0 = time.monotonic()
    msg_id = pool.execute(TRAIN.format(opts="--out x", steps=6, pause=0.4, tail="x = rank + 41"))
    sent = pool.collect(msg_id, timeout=30)
    assert sent.status == "ok" and time.monotonic() - t0 < 3.0, (sent, time.monotonic() - t0)
    assert not said(sent.stdout, 0, "step 5")  # the cell returned long before its ranks got there
    plain = pool.ok("1 + 1")  # the notebook is free meanwhile
    assert plain.result == "2"
    later = pool.follow(msg_id, pool_line_ended, timeout=60)
    text = sent.stdout + later.stdout
    for i in range(6):
        assert said(text, 0, f"step {i}") and said(text, 1, f"step {i}"), text
    assert "· ok" in last_line(later), last_line(later)
    assert pool.value("x") == 41  # landed at the next cell


def test_plain_cells_run_while_it_trains_and_a_cell_reading_its_names_waits_for_them(pool):
    msg_id = send(pool, TRAIN.format(opts="--gather losses", steps=8, pause=0.25, tail="losses = [rank] * 3"))
    t0 = time.monotonic()
    pool.ok("y = 2")
    assert time.monotonic() - t0 < 1.5  # not held by the background cell (2 s of training)
    res = pool.ok("print(sum(map(sum, losses)), y)", timeout=60)
    assert res.stdout.strip() == "3 2"
    assert "reads losses, which background cell" in res.stderr and "waiting for it" in res.stderr, res.stderr
    assert "losses arrived in the notebook" in res.stderr
    pool.follow(msg_id, pool_line_ended, timeout=30)


def test_a_second_background_cell_queues_and_a_blocking_cell_waits_for_both(pool):
    first = send(pool, TRAIN.format(opts="", steps=4, pause=0.3, tail="a = 1"))
    second_id = pool.execute(TRAIN.format(opts="", steps=2, pause=0.1, tail="b = a + 1"))
    second = pool.collect(second_id, timeout=30)
    assert "queued behind background cell" in second.stderr, second.stderr
    blocking = pool.ok("%%ddp\nprint('sum', a + b)", timeout=60)
    assert "waits for background cell" in blocking.stderr, blocking.stderr
    assert said(blocking.stdout, 0, "sum 3") and said(blocking.stdout, 1, "sum 3"), blocking.stdout
    for msg_id in (first, second_id):
        assert "· ok" in last_line(pool.follow(msg_id, pool_line_ended, timeout=30))


def test_interrupting_another_cell_never_reaches_the_background_ranks(pool):
    msg_id = send(pool, TRAIN.format(opts="--out done", steps=10, pause=0.3, tail="done = True"))
    sleeper = pool.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(30)")
    pool.follow(sleeper, lambda r: "sleeping" in r.stdout, timeout=20)
    pool.interrupt()
    res = pool.collect(sleeper, timeout=30)
    assert res.error and res.error["ename"] == "KeyboardInterrupt"
    later = pool.follow(msg_id, pool_line_ended, timeout=60)
    assert "· ok" in last_line(later), (last_line(later), later.error)
    assert said(later.stdout, 1, "step 9"), later.stdout
    assert pool.value("done") is True


def test_interrupting_ddp_wait_stops_the_waiting_not_the_training(pool):
    msg_id = send(pool, TRAIN.format(opts="", steps=12, pause=0.25, tail="z = 1"))
    wait_id = pool.execute("%ddp wait")
    pool.follow(wait_id, lambda r: "waiting for background cell" in r.stderr, timeout=20)
    pool.interrupt()
    res = pool.collect(wait_id, timeout=30)
    assert res.error and res.error["ename"] == "KeyboardInterrupt", res
    assert "stopped the waiting" in res.error_text and "%ddp interrupt stops it" in res.error_text
    assert "· ok" in last_line(pool.follow(msg_id, pool_line_ended, timeout=60))
    assert pool.ok("%ddp wait").error is None


def test_ddp_interrupt_stops_the_background_cell_as_an_interrupt_does_and_the_pool_keeps_its_state(pool):
    pool.ok("%%ddp\nkept = 10 + rank")
    msg_id = send(pool, "%%ddp --bg\nimport time\nfrom tqdm.auto import tqdm\n"
                        "for i in tqdm(range(1000), mininterval=0):\n    time.sleep(0.02)")
    pool.follow(msg_id, bars_shown, timeout=30)
    res = pool.ok("%ddp interrupt", timeout=60)
    assert "interrupting background cell" in res.stderr, res.stderr
    later = pool.follow(msg_id, lambda r: r.error is not None, timeout=60)
    assert later.error is not None and later.error["ename"] == "KeyboardInterrupt", later
    report = "\n".join(later.error["traceback"])
    assert "rank(s) 0-1 ran the cell" in report, report  # where every rank was, as a blocking cell says it
    assert re.search(r"were at Cell In\[\d+\], line 5", report) and "survived" in report, report
    assert "interrupted" in last_line(later)
    gathered = pool.ok("%%ddp --gather kept\nkept").error is None and pool.value("kept")
    assert gathered == [10, 11]  # the pool lived on, its state with it


def test_a_background_failure_is_reported_in_its_cell_and_said_once_in_the_next(pool):
    msg_id = send(pool, "%%ddp --bg\nimport time\ntime.sleep(0.3)\nif rank == 1:\n    raise ValueError('bad batch')\n"
                        "import torch.distributed as dist\ndist.barrier()")
    later = pool.follow(msg_id, lambda r: r.error is not None, timeout=60)  # (after the cell's line ended)
    report = "\n".join(later.error["traceback"])
    assert "rank 1" in report and "bad batch" in report, report
    nxt = pool.ok("1")
    assert "background cell" in nxt.stderr and "failed" in nxt.stderr and "bad batch" in nxt.stderr, nxt.stderr
    assert "bad batch" not in pool.ok("2").stderr  # said once
    waited = pool.run("%ddp wait")  # a headless run must still fail here, whatever cells ran in between
    assert waited.error is not None and waited.error["ename"] == "BackgroundFailed" and "bad batch" in waited.error_text
    assert pool.ok("%ddp wait").error is None  # raised once


def test_a_cell_reading_a_name_a_failed_background_cell_never_brought_fails_once(pool):
    pool.ok("losses = 'stale'")
    sent_id = pool.execute("%%ddp --bg --gather losses\nif rank == 1:\n    raise ValueError('bad batch')\nlosses = "
                           "[1.0]")
    if pool.collect(sent_id, timeout=30).error is None:
        pool.follow(sent_id, lambda r: r.error is not None, timeout=30)
    pool.ok("pass")  # its failure is said here
    res = pool.run("print('losses =', losses)")
    assert res.error is not None and res.error["ename"] == "BackgroundFailed", res
    assert "losses did not arrive; the cell did not run" in res.error_text and "stale" not in res.stdout
    assert pool.ok("%ddp wait").error is None  # raised once, by that cell
    assert "stale" in pool.ok("print(losses)").stdout  # then the notebook's own value, as it was


def test_ddp_wait_raises_a_failure_not_said_yet(pool):
    pool.execute("%%ddp --bg\nraise RuntimeError('diverged')")
    wait_id = pool.execute("%ddp wait")
    res = pool.collect(wait_id, timeout=60)
    assert res.error is not None and res.error["ename"] == "BackgroundFailed", res
    assert "diverged" in res.error_text


def test_attach_from_a_second_client_replays_then_goes_on_live_to_the_end(pool):
    msg_id = send(pool, "%%ddp --bg\nimport time\nfrom tqdm.auto import tqdm\n"
                        "for i in tqdm(range(30), mininterval=0):\n    print('tick', i, flush=True)\n    "
                  "time.sleep(0.1)\n"
                        "time.sleep(1.5)\nprint('the end', flush=True)")
    pool.follow(msg_id, lambda r: said(r.stdout, 1, "tick 3"), timeout=30)  # then the page is reloaded:
    other = pool.another_client()
    try:
        attach_id = other.execute("%ddp attach")
        got = other.collect(attach_id, timeout=30)
        assert said(got.stdout, 0, "tick 0") and said(got.stdout, 1, "tick 0"), got.stdout  # replayed
        assert not said(got.stdout, 0, "the end")
        shown = [d.get("transient", {}).get("display_id", "") for d in got.displays]
        assert any("-bars" in i for i in shown), shown  # each bar at its state now
        later = other.follow(attach_id, pool_line_ended, timeout=60)  # then live, to its outcome
        assert said(later.stdout, 1, "the end"), later.stdout
        assert "· ok" in last_line(later)
        again = other.run("%ddp attach")  # the last one, ended: all of it, at once
        assert said(again.stdout, 0, "the end") and "ended (ok)" in again.stderr
    finally:
        other.shutdown()
    pool.follow(msg_id, pool_line_ended, timeout=30)


def test_a_one_shot_background_cell_and_input_in_the_background(clean_kernel):
    k = clean_kernel
    msg_id = send(k, "%%ddp --bg --devices 2 --out w\nimport time\ntime.sleep(0.5)\nw = world_size * 10\n"
                     "print('done', flush=True)")
    assert k.value("w") == 20  # (the cell waits for it)
    later = k.follow(msg_id, lambda r: said(r.stdout, 0, "done"), timeout=30)
    assert said(later.stdout, 1, "done")
    asks = send(k, "%%ddp --bg --devices 2\ntry:\n    input('name? ')\nexcept Exception as e:\n"
                   "    print('no input:', type(e).__name__, flush=True)")
    later = k.follow(asks, lambda r: said(r.stdout, 0, "no input: StdinNotImplementedError"), timeout=30)
    k.ok("%ddp wait")


def test_a_second_one_shot_background_cell_queues_behind_the_first_and_both_land(clean_kernel):
    k = clean_kernel
    first = send(k, "%%ddp --bg --devices 2 --out a\nimport time\ntime.sleep(1.5)\na = 'first'\n")
    msg_id = k.execute("%%ddp --bg --devices 2 --out b\nb = 'second'\n")
    res = k.collect(msg_id, timeout=30)
    assert res.error is None and "queued behind background cell" in res.stderr, res.error_text + res.stderr
    assert "another nbddp launch is still running" not in res.error_text + res.stderr  # before: refused
    k.ok("%ddp wait", timeout=60)
    assert k.value("a, b") == ("first", "second")
    assert first


def test_a_queued_cell_starts_its_ranks_only_between_notebook_cells(clean_kernel):
    k = clean_kernel
    k.ok("import os, tempfile\nflags = tempfile.mkdtemp()\n")
    # the first cell ends once the notebook is busy (go), and says it is ending (done)
    send(k, "%%ddp --bg --devices 2\nimport os, time\nend = time.time() + 60\n"
            "while not os.path.exists(os.path.join(flags, 'go')) and time.time() < end:\n    time.sleep(0.01)\n"
            "open(os.path.join(flags, f'done{rank}'), 'w').close()\n")
    queued = k.execute("%%ddp --bg --devices 2 --out began\nimport time\nbegan = time.time()\n")
    assert k.collect(queued, timeout=30).error is None
    # the notebook, busy in torch ops while the first cell ends and 2 s past it: the queued one must not fork meanwhile
    k.ok("import time, torch\nopen(os.path.join(flags, 'go'), 'w').close()\na = torch.randn(256, 256)\nend = "
         "time.time() + 60\n"
         "while not all(os.path.exists(os.path.join(flags, f'done{r}')) for r in (0, 1)) and time.time() < end:\n"
         "    a = (a @ a).tanh()\nquiet_from = time.time()\n"
         "while time.time() - quiet_from < 2.0:\n    a = (a @ a).tanh()\nbusy_to = time.time()\n", timeout=90)
    k.ok("%ddp wait", timeout=60)
    began, busy_to = k.value("began, busy_to")
    assert began >= busy_to, (began, busy_to)
    said_it = k.follow(queued, lambda r: "starts when the notebook's running cell ends" in r.stderr, timeout=10)
    assert "starts when the notebook's running cell ends" in said_it.stderr


def test_ranks_get_the_kernels_interpreter_settings_whichever_thread_forks_them(clean_kernel):
    k = clean_kernel
    k.ok("import signal, sys\nsys.setswitchinterval(0.007)\nsignal.pthread_sigmask(signal.SIG_BLOCK, "
         "{signal.SIGWINCH})\n")
    probe = ("import signal, sys\nsettings = (sys.getswitchinterval(), "
             "signal.SIGWINCH in signal.pthread_sigmask(signal.SIG_BLOCK, []), "
             "signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n")
    try:
        k.ok("%%ddp --devices 2 --gather settings\n" + probe)
        blocking = k.value("settings")
        send(k, "%%ddp --bg --devices 2 --gather settings\n" + probe)
        k.ok("%ddp wait", timeout=60)
        background = k.value("settings")
        rounded = [[(round(s, 4), *rest) for s, *rest in found] for found in (blocking, background)]
        assert rounded == [[(0.007, True, False)] * 2] * 2, (blocking, background)
    finally:
        k.ok("sys.setswitchinterval(0.005)\nsignal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGWINCH})\n")


def test_bad_options_with_bg_launch_nothing(clean_kernel):
    res = clean_kernel.run("%%ddp --bg --devices 0\nprint('ran')")
    assert "ran" not in res.stdout and "--devices" in res.error_text
    res = clean_kernel.run("%ddp wait --timeout soon")
    assert "--timeout SECONDS" in res.error_text


def test_a_kernel_shut_down_mid_background_cell_leaves_nothing(runs_dir):
    """Jupyter's shutdown (a shutdown_request) while a background cell runs: the pool ends (by default it is kept only
    if the kernel is killed), nothing left: its ranks and its keeper."""
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok("%load_ext nbddp")
        k.ok("%ddp start --devices 2")
        send(k, "%%ddp --bg\nimport time\ntime.sleep(60)")
        kids = k.process().children(recursive=True)
        assert len(kids) >= 3 and "nbddp-keeper" in {p.name() for p in kids}, [(p.pid, p.name()) for p in kids]
        k.km.shutdown_kernel(now=False)
        gone, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_waiting_cell_may_start_with_future_imports_and_the_pool_api_waits_its_turn(pool):
    msg_id = send(pool, TRAIN.format(opts="--out late", steps=6, pause=0.2, tail="late = 'here'"))
    res = pool.ok("from __future__ import annotations\nprint(late)", timeout=60)
    assert res.stdout.strip() == "here" and "waiting for it" in res.stderr
    msg_id = send(pool, TRAIN.format(opts="", steps=6, pause=0.2, tail=""))
    res = pool.ok("magics = get_ipython().magics_manager.registry['DDPMagics']\n"
                  "print(magics.pool.run(lambda: 1), flush=True)", timeout=60)  # the ranks' API, not the magic
    assert "[1, 1]" in res.stdout and "waiting for the pool's cell running in the background" in res.stderr, res
    pool.follow(msg_id, pool_line_ended, timeout=30)


def test_a_background_cell_that_failed_is_left_out_of_the_export(pool, tmp_path):
    pool.ok("%%ddp\ngood = 1")
    sent_id = pool.execute("%%ddp --bg\nraise ValueError('late failure')")
    sent = pool.collect(sent_id, timeout=30)
    assert sent.status == "ok"  # the notebook cell returned; the failure is reported in its output
    if sent.error is None:
        pool.follow(sent_id, lambda r: r.error is not None, timeout=30)
    msg_id = pool.execute("1")
    assert "late failure" in pool.collect(msg_id, timeout=60).stderr  # its failure lands here, said once
    script = tmp_path / "train.py"
    pool.ok(f"%ddp_export {script}")
    lines = [ln.strip() for ln in script.read_text().splitlines()]
    assert "good = 1" in lines
    assert "raise ValueError('late failure')" not in lines  # (a comment at most)
