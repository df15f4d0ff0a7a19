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
