"""The keeper's rules when its kernel ends, in its own process (no fork: a rank is this test process, seen on its
pidfd, and the signals the keeper would send are recorded instead)."""
import os
import signal
import socket

from nbddp.keeper import keeper as kp
from nbddp.wire.keepmessages import About, KeptRank


def _orphaned(tmp_path, monkeypatch, **about) -> tuple[kp.Keeper, list]:
    """A keeper holding one rank (this process), its kernel's socket closed with nothing said: (it, the signals it
    sent its ranks)."""
    sent = []
    monkeypatch.setattr(kp.Rank, "signal", lambda self, sig, group=True: sent.append((self.rank, sig, group)))
    kernel, theirs = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "k.sock")
    listener.bind(path)
    keeper = kp.Keeper(theirs, listener, path)
    keeper.ranks = {0: kp.Rank(KeptRank(0, os.getpid(), ("pidfd",)), [os.pidfd_open(os.getpid())])}
    keeper.about = About(pool_id="0d95e7", devices="cpu (gloo)", world_size=1, options="--devices 1",
                         notebook="", started_at=0.0, keep_s=60.0, **about)
    kernel.close()
    keeper._on_holder(None, theirs)
    return keeper, sent


def test_a_pool_whose_kernel_ends_while_it_mends_the_pool_ends_and_says_why(tmp_path, monkeypatch):
    keeper, sent = _orphaned(tmp_path, monkeypatch, mending=True)
    try:
        assert "it was being mended when its kernel ended" in keeper.why, keeper.why
        assert sent == [(0, signal.SIGTERM, True)] and keeper.kill_at is not None, "its ranks ended, SIGKILL next"
        # said at once, while its ranks end: a kernel that looks then is told why, and never offered the pool
        assert "has ended: it was being mended" in (tmp_path / "k.ended").read_text()
    finally:
        keeper.close()


def test_a_whole_pool_idle_when_its_kernel_ends_waits_untouched(tmp_path, monkeypatch):
    keeper, sent = _orphaned(tmp_path, monkeypatch)
    try:
        assert keeper.why == "" and sent == [] and keeper.wait_until is not None and keeper.kill_at is None
    finally:
        keeper.close()


def test_the_cell_a_dead_kernel_waited_for_is_interrupted_in_each_rank_alone_and_a_bg_one_goes_on(tmp_path,
                                                                                                  monkeypatch):
    keeper, sent = _orphaned(tmp_path, monkeypatch, running="for step in range(10):")
    keeper.close()
    assert sent == [(0, kp.INTERRUPT, False)] and keeper.why == ""
    keeper, sent = _orphaned(tmp_path, monkeypatch, running="for step in range(10):", background=True)
    keeper.close()
    assert sent == [] and keeper.why == ""


def test_a_mending_cut_short_leaves_the_keeper_told_the_pool_is_being_mended():
    """Jupyter's restarter interrupts the kernel, then kills it: an interrupt that stops a mending must not tell the
    keeper "mended" before the kill lands while the pool is torn down (the keeper would keep ranks half regrouped)."""
    import types

    import pytest

    from nbddp.kernel.ranks import keeping
    from nbddp.wire import fdframing

    kernel, keeper = socket.socketpair()
    link = keeping.KeeperLink(kernel, keeper_pid=0)
    gang = types.SimpleNamespace(keeper=link, sup=object())
    try:
        with keeping.mending(gang):
            pass
        told = [fdframing.receive(keeper)[0].mending for _ in range(2)]
        assert told == [True, False], "mended: told before and after"
        with pytest.raises(KeyboardInterrupt), keeping.mending(gang):
            raise KeyboardInterrupt
        assert fdframing.receive(keeper)[0].mending is True
        keeper.setblocking(False)
        with pytest.raises(BlockingIOError):
            keeper.recv(1)  # nothing after it: the keeper still takes the pool for one being mended
    finally:
        kernel.close()
        keeper.close()


def test_what_ranks_printed_while_no_kernel_held_them_is_replayed_in_the_order_they_printed_it(monkeypatch):
    """Through real pipes: each rank's text kept (the newest KEPT_TEXT of a stream), and the order of the keeper's
    reads across ranks kept with it, so the next kernel replays it as it was written, not rank by rank."""
    monkeypatch.setattr(kp, "KEPT_TEXT", 8)
    clock, ranks, ends = kp.Clock(), [], []
    for rank in (0, 1):
        pipes = {s: os.pipe() for s in ("stdout", "stderr")}
        r = kp.Rank(KeptRank(rank, 0, tuple(pipes)), [read for read, _ in pipes.values()], clock)
        ranks.append(r)
        ends.append({s: w for s, (_, w) in pipes.items()})
    try:
        for rank, stream, text in [(0, "stdout", b"a0\n"), (1, "stdout", b"b0\n"), (0, "stdout", b"a1\n"),
                                   (1, "stderr", b"e!\n"), (1, "stdout", b"b1\n"), (0, "stdout", b"a2\n")]:
            os.write(ends[rank][stream], text)
            assert ranks[rank].take_in(stream)
        # rank 0's stdout kept its newest 8 bytes (of b"a0\na1\na2\n"): its first read only partly
        assert bytes(ranks[0].kept["stdout"]) == b"0\na1\na2\n" and ranks[0].dropped["stdout"] == 1
        order = kp.replay_order(ranks)
        assert order == [(0, "stdout", 2), (1, "stdout", 3), (0, "stdout", 3), (1, "stderr", 3), (1, "stdout", 3),
                         (0, "stdout", 3)], order
        replayed = b""
        at = {}
        for rank, stream, n in order:
            start = at.get((rank, stream), 0)
            replayed += ranks[rank].kept[stream][start:start + n]
            at[rank, stream] = start + n
        assert replayed == b"0\nb0\na1\ne!\nb1\na2\n"
        ranks[0].given()
        assert kp.replay_order(ranks[:1]) == [] and not ranks[0].kept["stdout"]
        clock = kp.Clock()  # bounded as the text is: a long training's reads are let go
        reads, other = kp.Reads(clock), kp.Reads(clock)
        for i in range(10_000):
            reads.add("stdout", 2, min(2 * (i + 1), 8))
            other.add("stdout", 1, 1)  # (another rank's read between each: none of them is one with the last)
        assert len(reads.reads["stdout"][1]) <= 4097
        assert [n for *_, n in reads.order(0, {"stdout": b"x" * 8, "stderr": b"", "channel": b""})] == [2, 2, 2, 2]
        for _ in range(3):  # reads with no other between them are one
            other.add("stderr", 5, 15)
        assert other.order(1, {"stdout": b"", "stderr": b"x" * 15, "channel": b""}) == [(clock.last, 1, "stderr", 15)]
    finally:
        for r, e in zip(ranks, ends):
            r.close()
            for fd in e.values():
                os.close(fd)
