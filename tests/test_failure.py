"""Choosing the root cause among ranks that ended badly (the kernel tests make these for real; here
the orderings that a loaded machine produces only sometimes are pinned down)."""
from nbddp.failure import RankExit, rank_failed, root_cause

LOST = {"ok": False, "kind": "exception", "type": "RuntimeError", "time": 100.0,
        "message": "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"}


def test_a_crash_seen_late_still_beats_the_peer_that_lost_it():
    crashed = RankExit(1, -11, None, seen=100.5, order=2)  # SIGSEGV, noticed after rank 0 raised
    lost = RankExit(0, 1, LOST, seen=100.2, order=1)
    assert root_cause([lost, crashed]) is crashed
    text = str(rank_failed([lost, crashed], {}, "/logs"))
    assert text.startswith("rank 1 failed: killed by SIGSEGV")
    assert "rank 0 also failed (likely a consequence): RuntimeError: [gloo" in text


def test_the_earliest_error_wins_among_real_ones():
    first = RankExit(1, 1, {"ok": False, "kind": "exception", "type": "ValueError", "message": "x", "time": 5.0})
    later = RankExit(0, -6, None, seen=9.0)  # e.g. an NCCL watchdog abort after rank 1 raised
    assert root_cause([later, first]) is first


def test_only_peer_lost_errors_still_name_one():
    a = RankExit(0, 1, dict(LOST, time=3.0))
    b = RankExit(1, 1, dict(LOST, time=2.0))
    assert root_cause([a, b]) is b
