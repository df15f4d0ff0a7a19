"""A pool that outlives its kernel (``%ddp start --keep``), through real kernels driven as Jupyter drives them: the
kernel killed by its restarter (``restart_kernel(now=True)``: SIGKILL to its process group), the next kernel told
and taking the pool, its ranks' state whole, a background training that went on; the wait running out; a second
taker and another user refused. Every process a test made is ended by pid, however it ends."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import stat
import time
from pathlib import Path

import psutil
import pytest

from kernel import Kernel, said
from nbddp.errors import UsageError
from nbddp.kernel.ranks import keeping
from nbddp.wire import fdframing
from nbddp.wire.keepmessages import About, Describe

pytestmark = pytest.mark.timeout(240)

POOL = "get_ipython().magics_manager.registry['DDPMagics'].pool"
RANKS = f"[p.pid for p in sorted({POOL}.gang.sup.live(), key=lambda p: p.rank)]"
KEEPER = "get_ipython().magics_manager.registry['DDPMagics'].pool.gang.keeper.keeper_pid"


@pytest.fixture
def runtime(monkeypatch):
    """A directory of this test's own for the keepers' sockets (XDG_RUNTIME_DIR), for its kernels and itself (short:
    a socket's path has room for 107 bytes)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="nbk-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def running(pids, within: float) -> list[int]:
    """The processes of ``pids`` still running once they all ended or ``within`` s passed (a zombie is not running:
    its parent, maybe init, reaps it)."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def restarted(k: Kernel) -> None:
    """Jupyter's restarter on a dead kernel: SIGKILL to the kernel's process group, a new kernel on the same ports."""
    k.km.restart_kernel(now=True)
    k.kc.wait_for_ready(timeout=60)


@contextlib.contextmanager
def kept(runtime, keep: str | None):
    """A kernel whose pool is started ``--keep KEEP`` (None: the default, auto): (the kernel, its ranks' pids, its
    keeper's, the pids to end: every process there ended by pid however the test ends)."""
    pids: list[int] = []
    with Kernel(env={"XDG_RUNTIME_DIR": str(runtime), "JPY_SESSION_NAME": "keep.ipynb"}) as k:
        try:
            ranks, keeper = kept_pool(k, keep)
            pids += [*ranks, keeper]
            yield k, ranks, keeper, pids
        finally:
            kill(pids)


def kept_pool(k: Kernel, keep: str | None) -> tuple[list[int], int]:
    k.ok("%load_ext nbddp")
    res = k.ok("%ddp start --devices 2" + (f" --keep {keep}" if keep else ""))
    assert "pool of 2 rank(s) on cpu/gloo ready" in res.stdout, res
    return k.value(RANKS), k.value(KEEPER)


def test_the_next_kernel_takes_a_kept_pool_with_its_state_after_jupyter_restarts_a_killed_kernel(runtime):
    with kept(runtime, "2m") as (k, ranks, keeper, pids):
        k.ok("%%ddp\nimport torch\nstate = torch.full((1 << 20,), float(rank + 1))\nprint('made', rank)")
        restarted(k)
        assert running(ranks, 0) == ranks, "the ranks outlived their kernel"
        res = k.ok("%load_ext nbddp")
        assert "1 kept pool(s) wait for a kernel" in res.stdout and "2 rank(s) alive" in res.stdout, res
        assert "its ranks hold state, torch;" in res.stdout and "running" not in res.stdout, "the names its cells bound"
        assert "%ddp attach takes it" in res.stdout, res
        assert not k.value("'torch' in __import__('sys').modules"), "the way back to a kept pool needs no torch here"
        res = k.run("%ddp start --devices 3 --keep 2m")  # other options: refused, naming it and the ways out
        assert "a pool kept from this notebook waits, started with other options" in res.error_text, res
        assert "%ddp attach" in res.error_text and "%ddp stop" in res.error_text, res
        res = k.ok("%ddp start --devices 2 --keep 2m")  # "Run All" after a restart: the same options take it
        assert "took kept pool" in res.stdout and "taking it" in res.stderr, res
        assert k.value(RANKS) == ranks, "the same processes, taken"
        k.ok("extra = 10")  # a name of the new kernel's: sent, as to a spawned pool's ranks
        res = k.ok("%%ddp\nimport torch.distributed as dist\ndist.all_reduce(state)\n"
                   "print(rank, state[0].item() + extra, state.numel())")
        for r in (0, 1):
            assert said(res.stdout, r, f"{r} 13.0 1048576"), res
        # Jupyter's interrupt reaches the taken ranks (their cell), and the pool lives on
        res = k.interrupt_when("%%ddp\nimport time\nprint('up', flush=True)\ntime.sleep(60)", "up", 2)
        assert res.error and res.error["ename"] == "KeyboardInterrupt" and "survived" in res.error_text, res
        # a rank lost is healed from a peer: a fork of this kernel, tied to the keeper, told to it
        os.kill(ranks[1], signal.SIGKILL)  # (not this kernel's child: how it ended is unknown here)
        res = k.run("%%ddp\nprint(rank)")  # (the loss seen before it, or during it: then it fails, saying so)
        assert "healed the pool" in res.stderr + (res.error_text if res.error else ""), res
        assert not res.error or "rank 1 failed: ended; how is unknown" in res.error_text, res
        k.ok("%%ddp\nimport torch\nstate = torch.full((4,), 3.0)")  # (one survivor cannot vouch for its names)
        healed = k.value(RANKS)
        assert healed[0] == ranks[0] and healed[1] != ranks[1]
        pids.append(healed[1])
        # ... and kept again, with it, across the next kernel's end
        restarted(k)
        k.ok("%load_ext nbddp")
        assert "took kept pool" in k.ok("%ddp attach").stdout
        assert k.value(RANKS) == healed
        res = k.ok("%%ddp\nprint(rank, state[0].item())")
        assert said(res.stdout, 0, "0 3.0") and said(res.stdout, 1, "1 3.0"), res
        res = k.ok("%ddp stop")
        assert "pool stopped" in res.stdout
        assert not running(pids, 15), "every rank and the keeper end with the pool"
        assert not list(runtime.glob("nbddp/*.sock")), "its socket file removed"


def test_by_default_a_pool_is_kept_if_its_kernel_is_killed_and_a_deliberate_restart_ends_it(runtime):
    """--keep auto, the default: the kernel killed (Jupyter's restarter after a crash, SIGKILL to its group), the pool
    waits 10 minutes and "Run All"'s own %ddp start takes it; Jupyter's "Restart Kernel" (a shutdown_request: Python's
    atexit runs) ends it, every rank and the keeper gone."""
    with kept(runtime, None) as (k, ranks, keeper, pids):
        k.ok("%%ddp\nimport nbddp\nmine = rank + 1\nnbddp.log(loss=float(rank))")
        restarted(k)
        assert running(ranks, 0) == ranks, "kept, with no --keep given"
        res = k.ok("%load_ext nbddp")
        assert "1 kept pool(s) wait for a kernel" in res.stdout and "10 min left" in res.stdout, res
        res = k.ok("%ddp start --devices 2")
        assert "took kept pool" in res.stdout and k.value(RANKS) == ranks, res
        res = k.ok("%%ddp\nprint(rank, mine)")
        assert said(res.stdout, 0, "0 1") and said(res.stdout, 1, "1 2"), res
        history = "sorted(__import__('nbddp.kernel.metrics', fromlist=['_']).LOGBOOK.columns()['loss'])"
        assert k.value(history) == [0.0, 1.0], "what the ranks logged under the last kernel: nbddp.metrics() has it"
        k.km.restart_kernel(now=False)
        k.kc.wait_for_ready(timeout=60)
        assert not running(pids, 15), "a deliberate restart ends it: every rank and the keeper"
        assert not list(runtime.glob("nbddp/*.sock"))
        res = k.ok("%load_ext nbddp\n%ddp pools")
        assert "no kept pool" in res.stdout and "wait for a kernel" not in res.stdout, res


def test_the_cell_a_killed_kernel_was_running_is_interrupted_in_its_ranks_and_the_pool_kept(runtime):
    """The kernel killed in the middle of a pool cell (not --bg): nobody waits for that cell any more, so the keeper
    interrupts it in the ranks (a KeyboardInterrupt, as Jupyter's interrupt) and the next kernel takes the pool at
    once, not after the cell's minute."""
    with kept(runtime, None) as (k, ranks, keeper, pids):
        run_dir = k.value(f"{POOL}.run_dir.path.as_posix()")
        msg = k.execute("%%ddp\nimport time\nprint('up', flush=True)\nfor i in range(600):\n    time.sleep(0.1)\n")
        k.follow(msg, lambda r: said(r.stdout, 0, "up") and said(r.stdout, 1, "up"), timeout=30)
        restarted(k)
        res = k.ok("%load_ext nbddp")
        assert "a cell was running (interrupted) in them: import time;" in res.stdout, res
        t0 = time.monotonic()
        res = k.ok("%ddp attach", timeout=60)
        assert "took kept pool" in res.stdout and time.monotonic() - t0 < 20, res
        assert k.value(RANKS) == ranks
        res = k.ok("%%ddp\nprint(rank, 'after', 'i' in globals() and i < 599)")
        assert said(res.stdout, 0, "0 after True") and said(res.stdout, 1, "1 after True"), res
        assert "interrupting the cell its kernel was running" in open(os.path.join(run_dir, "keeper.log")).read()
        k.ok("%ddp stop")
        assert not running(pids, 15)


def test_a_background_training_goes_on_while_no_kernel_holds_the_pool_and_loses_no_step(runtime):
    with kept(runtime, "2m") as (k, ranks, keeper, pids):
        csv = Path(k.value(f"{POOL}.run_dir.path.as_posix()")) / "metrics.csv"
        k.ok("%%ddp --bg --gather done --out last\nimport time, torch, torch.distributed as dist, nbddp\ndone = 0\n"
             "for step in range(40):\n    t = torch.ones(1)\n    dist.all_reduce(t)\n    done += int(t.item())\n"
             "    nbddp.log(seen=step)\n    print('step', step, 'on', rank, flush=True)\n    time.sleep(0.1)\n"
             "last = step\n'end'\n")  # (a line of each rank's own: the relay merges none)
        deadline = time.monotonic() + 20  # some steps in, logged and written to the run's metrics.csv: then it dies
        while not (csv.exists() and len(csv.read_text().splitlines()) > 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert csv.exists(), "the cell's Recorder wrote nothing while it ran"
        restarted(k)
        res = k.ok("%load_ext nbddp")
        assert "a --bg cell was running in them: import time, torch, torch.distributed as dist, nbddp;" in \
            res.stdout, res
        msg = k.execute("%ddp attach")  # the training the last kernel left running: this kernel's background cell
        res = k.ok("print('got', last, done)", timeout=60)  # its --out/--gather names pending: this cell waits for them
        assert "got 39 [80, 80]" in res.stdout, res
        res = k.follow(msg, lambda r: said(r.stdout, 0, "step 39 on 0") and said(r.stdout, 1, "step 39 on 1"),
                       timeout=60)
        assert "took kept pool" in res.stdout and "goes on as background cell" in res.stderr, res
        shown = [int(n) for n in re.findall(r"^\[rank0\]:step (\d+) on 0$", res.stdout, re.M)]
        assert shown and 0 < shown[0] and shown == list(range(shown[0], 40)), \
            f"what it printed while no kernel held the pool, replayed, then the rest, each step once: {res.stdout}"
        steps = [int(n) for n in re.findall(r"^\[rank[01]\]:step (\d+) on [01]$", res.stdout, re.M)]
        assert all(n >= max(steps[:i] or [0]) - 1 for i, n in enumerate(steps)), \
            f"both ranks' lines in the order they printed them, not rank by rank: {steps}"
        assert "(the kernel before)" in k.ok("%ddp status").stdout
        k.ok("%ddp wait", timeout=60)
        assert k.value("done, last") == ([80, 80], 39), "its --gather and --out names, brought to this kernel"
        line = k.follow(msg, lambda r: any("· ok" in d["data"].get("text/plain", "") for d in r.displays)
                        and any(d["data"].get("text/plain") == "'end'" for d in r.displays), timeout=30)  # (its value)
        drawn = [d["data"]["text/html"] for d in line.displays if "<polyline" in d["data"].get("text/html", "")][-1]
        curves = [len(points.split()) for points in re.findall(r"<polyline points='([^']*)'", drawn)]
        res = k.ok("%%ddp\nprint(rank, done)")
        for r in (0, 1):
            assert said(res.stdout, r, f"{r} 80"), f"every step's all_reduce done, none lost: {res}"
        logged = k.value("(lambda c: sorted(zip(c['rank'], c['seen'])))"
                         "(__import__('nbddp.kernel.metrics', fromlist=['_']).LOGBOOK.columns())")
        for r in (0, 1):  # before the kernel died (its metrics.csv), and after (what the keeper kept of the channel)
            seen = [v for rank, v in logged if rank == r]
            assert seen[0] == 0 and seen[-1] == 39 and len(seen) >= 30, (r, seen)  # (at most WRITE_EVERY_S lost)
            assert curves[r] == len(seen), f"the attach cell's chart has every step logged, both kernels': {curves}"
        run_dir = k.value("get_ipython().magics_manager.registry['DDPMagics'].pool.run_dir.path.as_posix()")
        log = open(os.path.join(run_dir, "rank0.log")).read()
        assert "step 39" in log and "step 0" in log, "what it printed while no kernel held it is in its log"
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in Path(run_dir).iterdir() if f.is_file()}
        assert modes["keeper.log"] == 0o600 and set(modes.values()) == {0o600}, modes  # private, as every file of a run
        k.ok("%ddp stop")
        assert not running(pids, 15)


def test_a_taken_background_cell_is_interrupted_by_ddp_interrupt_and_its_failure_is_said_naming_the_rank(runtime):
    """The --bg cell a dead kernel left running, a background cell of the next kernel's: ``%ddp interrupt`` reaches
    it in the ranks (the pool lives on); one that fails after the take fails as a background cell does, the rank and
    its exception named."""
    with kept(runtime, None) as (k, ranks, keeper, pids):
        k.ok("%%ddp --bg\nimport time\nfor i in range(600):\n    time.sleep(0.1)\n    print('at', i, flush=True)\n")
        restarted(k)
        res = k.ok("%load_ext nbddp\n%ddp attach")
        assert "goes on as background cell" in res.stderr, res
        res = k.ok("%ddp interrupt", timeout=60)
        assert "interrupting background cell" in res.stderr, res
        res = k.ok("%%ddp\nprint(rank, 'after', i < 599)")
        assert said(res.stdout, 0, "0 after True") and said(res.stdout, 1, "1 after True"), res
        k.ok("%%ddp --bg\nimport time\nfor i in range(30):\n    time.sleep(0.1)\nif rank == 1:\n"
             "    raise ValueError('boom at the end')\n")
        restarted(k)
        res = k.run("%load_ext nbddp\n%ddp attach")  # (its failure, if it comes by then, in its output: here)
        assert "took kept pool" in res.stdout and (not res.error or res.error["ename"] == "RankFailure"), res
        res = k.run("%ddp wait", timeout=60)
        assert res.error and "rank 1 failed the cell the last kernel left running" in res.error_text and \
            "ValueError: boom at the end" in res.error_text, res
        assert said(k.ok("%%ddp\nprint(rank, 'lives')").stdout, 1, "1 lives"), "the pool lives on"
        k.ok("%ddp stop")
        assert not running(pids, 15)


def test_ddp_detach_hands_the_pool_to_its_keeper_and_a_kernel_takes_it_back(runtime):
    """``%ddp detach``: this kernel lets go of its pool as it is (nothing ends, no rank is signalled); another kernel
    of the user takes it, state whole, and gives it back; ended from there, its ranks (the first kernel's children)
    leave no zombie. A --bg cell running is waited for first; a pool with no keeper is refused, nothing changed."""
    with kept(runtime, None) as (k, ranks, keeper, pids):
        k.ok("%%ddp\nmine = rank * 10")
        k.ok("%%ddp --bg\nimport time\ntime.sleep(1)\nafter = mine + 1")
        res = k.ok("%ddp detach")  # (as every verb that needs the ranks: once the --bg cell is over)
        assert "%ddp detach waits for background cell" in res.stderr, res
        pool_id = k.value("__import__('nbddp.kernel.ranks.keeping', fromlist=['_']).kept()[0].pool_id")
        assert f"pool {pool_id} detached" in res.stdout and f"%ddp attach {pool_id}" in res.stdout, res
        assert "no pool is running" in k.ok("%ddp status").stdout
        assert running(ranks, 0) == ranks, "nothing ended"
        with Kernel(env={"XDG_RUNTIME_DIR": str(runtime)}) as k2:
            res = k2.ok("%load_ext nbddp")
            assert "1 kept pool(s) wait for a kernel" in res.stdout, res
            assert "took kept pool" in k2.ok(f"%ddp attach {pool_id}").stdout
            res = k2.ok("%%ddp\nprint(rank, mine, after)")
            assert said(res.stdout, 0, "0 0 1") and said(res.stdout, 1, "1 10 11"), res
            k2.ok("%ddp detach")
            assert "took kept pool" in k.ok("%ddp attach").stdout, "back in the kernel that started it"
            assert said(k.ok("%%ddp\nprint(rank, mine)").stdout, 1, "1 10")
            k.ok("%ddp detach")
            assert f"kept pool {pool_id} ended" in k2.ok(f"%ddp stop {pool_id}").stdout
        deadline = time.monotonic() + 15
        while any(psutil.pid_exists(pid) for pid in [*ranks, keeper]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if psutil.pid_exists(pid)], "reaped by the kernel that forked them"
        k.ok("%ddp start --devices 2 --keep off")
        res = k.run("%ddp detach")
        assert "this pool has no keeper to hand it to" in res.stdout + res.error_text, res
        assert said(k.ok("%%ddp\nprint(rank, 'still')").stdout, 1, "1 still"), "its pool, as it was"
        k.ok("%ddp stop")


def test_a_kernel_killed_during_ddp_start_leaves_nothing_or_a_whole_kept_pool(runtime):
    """Jupyter's restarter kills the kernel as soon as the pool's keeper is up, its ranks forking or its first Hold on
    the way: either the keeper never got the pool (its ranks, tied to it, end with it: nothing left, no socket), or
    it did and keeps it whole (2 ranks alive, taken by the next kernel). Nothing hangs, nothing is left."""
    with Kernel(env={"XDG_RUNTIME_DIR": str(runtime), "JPY_SESSION_NAME": "keep.ipynb"}) as k:
        k.ok("%load_ext nbddp")
        k.execute("%ddp start --devices 2")
        deadline, seen = time.monotonic() + 30, []
        while not any(p.name() == "nbddp-keeper" for p in seen) and time.monotonic() < deadline:
            seen = k.process().children(recursive=True)
        assert seen, "the keeper never started"
        pids = [p.pid for p in seen]
        try:
            restarted(k)
            res = k.ok("%load_ext nbddp\n%ddp pools")
            if "no kept pool" not in res.stdout:  # the Hold went through first: kept, whole
                assert "2 rank(s) alive" in res.stdout, res
                assert "took kept pool" in k.ok("%ddp start --devices 2").stdout
                pids += k.value(RANKS)
                assert said(k.ok("%%ddp\nprint(rank, 'up')").stdout, 1, "1 up")
                k.ok("%ddp stop")
            assert not running(pids, 15), "every rank and the keeper ended"
            assert not list(runtime.glob("nbddp/*.sock"))
        finally:
            kill(pids)


def test_a_kernel_killed_while_it_heals_a_lost_rank_leaves_a_whole_kept_pool_or_nothing(runtime):
    """Rank 1 killed, and the kernel killed as soon as it forked the replacement (before or after it told the
    keeper): either the keeper has the healed pool (taken whole by the next kernel), or it ends the pool at once,
    saying why; the replacement, tied to the keeper, ends with it. Nothing hangs, nothing is left."""
    with kept(runtime, "2m") as (k, ranks, keeper, pids):
        os.kill(ranks[1], signal.SIGKILL)
        deadline, new = time.monotonic() + 20, []
        while not new and time.monotonic() < deadline:
            new = [p.pid for p in k.process().children() if p.pid not in (*ranks, keeper)]
        assert new, "no replacement forked"
        restarted(k)
        pids += new
        res = k.ok("%load_ext nbddp\n%ddp pools")
        if "kept pool(s) wait" in res.stdout:  # the healed pool was told to the keeper first
            assert "2 rank(s) alive" in res.stdout, res
            assert "took kept pool" in k.ok("%ddp attach").stdout
            pids += k.value(RANKS)
            assert said(k.ok("%%ddp\nprint(rank, 'up')").stdout, 1, "1 up")
            k.ok("%ddp stop")
        else:
            assert "when its kernel ended (a pool is mended by a kernel" in res.stdout, res
        assert not running(pids, 15), "every rank, the replacement and the keeper ended"
        assert not list(runtime.glob("nbddp/*.sock"))


def test_a_kept_pool_nobody_takes_ends_when_its_wait_runs_out_its_background_cell_too(runtime):
    with kept(runtime, "2s") as (k, ranks, keeper, pids):
        k.ok("%%ddp --bg\nimport time\ntime.sleep(120)")  # (a training nobody came back for: it ends with the pool)
        restarted(k)
        assert running(pids, 0) == pids, "kept at first"
        assert not running(pids, 10), "ended once its 2 s ran out: every rank and its keeper"
        assert not list(runtime.glob("nbddp/*.sock"))
        res = k.ok("%load_ext nbddp\n%ddp pools")
        assert "no kernel took it within its --keep 2 s; it ended" in res.stdout, "the next kernel is told, once"
        assert "no kept pool" in res.stdout, res
        assert "it ended" not in k.ok("%reload_ext nbddp").stdout


def test_a_kept_pool_whose_keeper_is_killed_ends_with_it(runtime):
    with kept(runtime, "2m") as (k, ranks, keeper, pids):
        k.ok("%%ddp --gather child\nimport subprocess\nchild = subprocess.Popen(['sleep', '600']).pid")
        children = k.value("child")  # (a DataLoader's workers, say: in the rank's process group)
        pids += children
        restarted(k)
        os.kill(keeper, signal.SIGKILL)
        assert not running([*ranks, *children], 5), "its ranks die with it (its pidfd), their children with them"
        res = k.ok("%load_ext nbddp\n%ddp pools")
        assert "no kept pool" in res.stdout, res
        assert not list(runtime.glob("nbddp/*.sock")), "its socket file, left by the killed keeper, removed"


def test_a_rank_lost_while_no_kernel_holds_the_pool_ends_it_and_the_next_kernel_is_told(runtime):
    with kept(runtime, "2m") as (k, ranks, keeper, pids):
        restarted(k)
        os.kill(ranks[1], signal.SIGKILL)  # (no kernel to heal it: the pool ends, nothing left)
        assert not running(pids, 10)
        res = k.ok("%load_ext nbddp")
        assert f"rank 1 (pid {ranks[1]}) ended while no kernel held the pool" in res.stdout, res
        assert "kept pool(s) wait" not in res.stdout, res


def test_a_kept_pool_whose_idle_rank_does_not_answer_the_take_is_ended_naming_it_not_waited_for(runtime):
    """Nothing hangs: ranks a new kernel cannot reach (here rank 1 stopped, as a rank half regrouped would sit) fail
    the take within timeline.TAKE_S, naming the silent rank; the pool ends, nothing left."""
    with kept(runtime, "2m") as (k, ranks, keeper, pids):
        restarted(k)
        os.kill(ranks[1], signal.SIGSTOP)
        try:
            k.ok("%load_ext nbddp\nimport nbddp.timeline\nnbddp.timeline.TAKE_S = 2.0")
            start = time.monotonic()
            res = k.run("%ddp attach", timeout=30)
            assert time.monotonic() - start < 15, "within TAKE_S (and the ranks' end), not waited for ever"
            assert "rank(s) 1 did not answer this kernel's first call within 2 s" in res.error_text, res
            assert "it has ended" in res.error_text and "%ddp start begins a new pool" in res.error_text, res
            assert not running(pids, 10), "every rank (the stopped one killed) and the keeper ended"
            assert "no kept pool" in k.ok("%ddp pools").stdout
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ranks[1], signal.SIGCONT)


def test_a_held_pool_is_refused_to_a_second_taker_and_to_another_user(runtime):
    with kept(runtime, "2m") as (k, ranks, keeper, pids):
        (about,) = keeping.kept()
        assert about.holder_pid == k.pid and about.ranks_alive == 2
        with pytest.raises(UsageError, match=f"kernel pid {k.pid} holds it"):
            keeping.take(about.pool_id)
        assert k.value(RANKS) == ranks, "nothing changed"
        assert keeping.socket_dir().stat().st_mode & 0o777 == 0o700
        if os.geteuid() == 0:  # (becoming another user takes root: this machine's and CI's tests run as root)
            took = _as_nobody(keeping.socket_dir() / f"{about.pool_id}.sock")
            assert took.startswith("refused"), took
        k.ok("%ddp stop")
        assert not running(pids, 15)


def _as_nobody(path) -> str:
    """What another user (nobody) gets from the keeper at ``path``: the directory opened to it for the test, so that
    the keeper's own check (its peer's uid) is what refuses it."""
    for d in (path.parent.parent, path.parent):
        os.chmod(d, 0o711)
    os.chmod(path, 0o666)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        answer = b"no answer"
        try:
            os.setgid(65534)
            os.setuid(65534)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(5)
            t0 = time.monotonic()
            conn.connect(str(path))
            try:  # closed at once: the send may find it closed already, or the answer never comes
                fdframing.send(conn, Describe())
                got, _ = fdframing.receive(conn)
                answer = f"answered {type(got).__name__}".encode()
            except (EOFError, ConnectionResetError, BrokenPipeError):
                answer = f"refused in {time.monotonic() - t0:.3f} s".encode()
        except BaseException as e:  # noqa: BLE001 - said to the parent
            answer = f"{type(e).__name__}: {e}".encode()
        os.write(w, answer)
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            return f.read().decode()
    finally:
        os.waitpid(pid, 0)
        for d in (path.parent.parent, path.parent):
            os.chmod(d, 0o700)


@pytest.mark.unit
def test_keep_is_for_pools_and_takes_a_duration():
    from nbddp import units
    from nbddp.kernel import checks, options

    assert [units.seconds(t) for t in ("30s", "10m", "2h", "1.5h", "90")] == [30, 600, 7200, 5400, 90]
    for bad in ("0", "-1m", "soon", ""):
        with pytest.raises(ValueError):
            units.seconds(bad)
    assert options.parse("--keep")["keep"] == "1h" and options.parse("--keep 10m")["keep"] == "10m"
    with pytest.raises(UsageError, match="--keep 'soon': need a duration"):
        options.parse("--keep soon")
    with pytest.raises(UsageError, match="a one-shot cell's ranks end with it"):
        checks.refusals(options.config({"keep": "10m"}))
    with pytest.raises(UsageError, match="not for a pool across Ray nodes"):
        checks.refusals(options.config({"keep": "10m", "cluster": "ray"}), pool=True)
    with pytest.raises(UsageError, match="not a pool whose ranks start by forkserver"):
        checks.preflight(options.config({"keep": "10m", "start_method": "forkserver", "devices": "2"}), pool=True)
    assert checks.preflight(options.config({"start_method": "forkserver", "devices": "2"}), pool=True)  # (auto: not)
    assert options.line(options.config({"keep": "10m", "devices": 2})) == "--devices 2 --keep 10m"
    about = About("p", "cpu (gloo)", 2, "--keep 10m", "a.ipynb", 0.0, 600.0, orphaned_at=time.time() - 60)
    assert "waiting for a kernel, 9 min left" in keeping.describe(about)
