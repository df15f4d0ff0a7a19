"""Choosing the root cause among ranks that ended badly (the kernel tests make these for real; here
the orderings that a loaded machine produces only sometimes are pinned down)."""
from nbddp.channel import Error, Exit, Result
from nbddp.failure import RankExit, notes, rank_failed, root_cause


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
