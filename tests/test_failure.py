"""Choosing the root cause among ranks that ended badly (the kernel tests make these for real; here
the orderings that a loaded machine produces only sometimes are pinned down)."""
import pytest

from nbddp.kernel.ranks.failure import RankExit, notes, rank_failed, root_cause
from nbddp.wire.messages import Error, Exit, Result

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)


def lost(time: float, phase: str = "cell") -> Error:
    return Error(phase, "RuntimeError", "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234",
                 "", time)


def test_a_crash_seen_late_still_beats_the_peer_that_lost_it():
    crashed = RankExit(1, -11, None, seen=100.5, order=2)  # SIGSEGV, noticed after rank 0 raised
    peer = RankExit(0, 1, error=lost(100.0), seen=100.2, order=1)
    assert root_cause([peer, crashed]) is crashed
    text = str(rank_failed([peer, crashed], {}, "/logs"))
    assert text.startswith("rank 1 failed: killed by SIGSEGV")
    assert "rank 0 also failed (likely a consequence): RuntimeError: [gloo" in text


def test_the_earliest_error_wins_among_real_ones():
    first = RankExit(1, 1, error=Error("cell", "ValueError", "x", "", 5.0))
    later = RankExit(0, -6, None, seen=9.0)  # e.g. an NCCL watchdog abort after rank 1 raised
    assert root_cause([later, first]) is first


def test_only_peer_lost_errors_still_name_one():
    a = RankExit(0, 1, error=lost(3.0))
    b = RankExit(1, 1, error=lost(2.0))
    assert root_cause([a, b]) is b


def test_a_rank_that_left_early_is_the_cause_of_its_peers_lost_collective():
    left = RankExit(1, 0, left=Exit(0, 'Cell In[4], line 3: sys.exit(0)', "cell", 10.0), order=1)
    peer = RankExit(0, 1, error=lost(9.0), order=2)  # even when the peer's error is stamped earlier
    assert root_cause([peer, left]) is left
    text = str(rank_failed([peer, left], {}, "/logs"))
    assert text.startswith("rank 1 left early: it called sys.exit(0) at Cell In[4], line 3: sys.exit(0)")
    assert "rank 0 also failed (likely a consequence): RuntimeError" in text


def test_a_failure_only_while_leaving_after_results_were_sent_is_a_note_not_a_failure():
    left = RankExit(1, 0, left=Exit(0, "", "cell", 10.0))
    leaving = RankExit(0, 1, error=lost(11.0, phase="leave"), result=Result())
    assert root_cause([leaving, left]) is None
    said = notes([leaving, left], {})
    assert any(n.startswith("rank 1 left early") for n in said)
    assert any("could not leave the process group" in n for n in said)


def test_setup_failures_name_their_phase():
    e = RankExit(1, 1, error=Error("group", "RuntimeError", "injected", "", 1.0))
    assert str(rank_failed([e], {}, "/logs")).startswith(
        "rank 1 failed while joining the process group: RuntimeError: injected")


# -- a rank's stack as the user reads it (tracebacks.py; the kernel tests see it for real) ---------------
def dump(pkg: str, cell: str) -> str:
    """faulthandler's text for a forked rank whose SIGUSR1 landed on nbddp's flusher thread."""
    import threading

    return "\n".join([
        "Current thread 0x00007f01 (most recent call first):",
        f'  File "{pkg}/worker.py", line 290 in flush_forever',
        f'  File "{threading.__file__}", line 982 in run',
        "",
        "Thread 0x00007f02 (most recent call first):",
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 4000 in barrier',
        f'  File "{pkg}/usergroup.py", line 50 in wrapper',
        f'  File "{cell}", line 7 in <module>',
        f'  File "{pkg}/cell.py", line 102 in run_in',
        f'  File "{pkg}/worker.py", line 97 in run_rank',
        f'  File "{pkg}/magic.py", line 134 in ddp',
        '  File "/tmp/ipykernel_1/163012694.py", line 1 in <module>',
        '  File "/site-packages/ipykernel/kernelapp.py", line 768 in start',
        '  File "<frozen runpy>", line 198 in _run_module_as_main',
    ])


def test_a_ranks_stack_keeps_only_the_users_frames_of_the_threads_that_have_some():
    import os

    import nbddp
    from nbddp.ipy import tracebacks

    pkg = os.path.dirname(nbddp.__file__)
    labels = {"/tmp/ipykernel_1/42.py": "Cell In[5]", "/tmp/ipykernel_1/163012694.py": "Cell In[6]"}
    text = dump(pkg, "/tmp/ipykernel_1/42.py")
    assert tracebacks.user_stack(text, labels) == [  # an installed library's file as its import path reads
        '  File "torch/distributed/distributed_c10d.py", line 4000 in barrier',
        "  Cell In[5], line 7 in <module>",
    ]
    assert tracebacks.where(tracebacks.main_thread(text), labels) == "Cell In[5], line 7, in <module>"
    assert tracebacks.where(tracebacks.main_thread(text.replace("42.py", "43.py")), labels) == (
        'File "torch/distributed/distributed_c10d.py", line 4000, in barrier')  # no cell: innermost


def test_many_ranks_that_say_the_same_are_said_once():
    """600 ranks stuck or failing alike: one line (ranges of ranks), not 600 stacks or lines."""
    from nbddp.kernel.ranks.failure import RankExit, interrupted, rank_failed, timed_out
    from nbddp.units import ranks_text
    from nbddp.wire.messages import Error

    assert ranks_text([3]) == "rank 3" and ranks_text([0, 1]) == "ranks 0-1"
    assert ranks_text([*range(17), *range(18, 600)]) == "ranks 0-16,18-599"
    err = Error(phase="cell", type="ValueError", message="boom", traceback="ValueError: boom\n", time=1.0)
    exits = [RankExit(r, 1, error=err) for r in range(600)]
    text = str(rank_failed(exits, {}, "/runs/x"))
    assert "ranks 1-599 failed the same way" in text and text.count("failed the same way") == 1, text
    stack = 'Thread 0x1 (most recent call first):\n  File "/tmp/ipykernel_1/2.py", line 4 in <module>\n'
    text = str(timed_out(2, list(range(600)), {r: stack for r in range(600)}, {"/tmp/ipykernel_1/2.py": "Cell In[2]"},
                         "/runs/x"))
    assert "with ranks 0-599 still running" in text and text.count("were here:") == 1 and "rankN.log" in text, text
    exc = interrupted([0, 1, 2], {0: "was at Cell In[2], line 4", 1: "was at Cell In[2], line 4",
                                  2: "failed: ValueError: x"}, "/runs/x", "nbddp stopped every rank")
    assert "ranks 0-1 were at Cell In[2], line 4" in str(exc) and "rank 2 failed: ValueError: x" in str(exc)
