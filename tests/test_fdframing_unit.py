"""The forkserver's exchange without a kernel: wire/fdframing.py over a socketpair (descriptors passed,
frames however the reads split, the other end gone), and the two ends (rank/forkloop.py's server on a
thread, kernel/ranks/forkserver.py's client) answering and raising as they should."""
import os
import socket
import subprocess
import threading
import time

import pytest

from nbddp.kernel.ranks import forkserver
from nbddp.rank import forkloop
from nbddp.wire import fdframing
from nbddp.wire.forkmessages import Fork, Forked, JobSet, Reaped, Refused, SetJob

WAIT_S = 10.0


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def _open_fds() -> set[int]:
    return set(map(int, os.listdir("/proc/self/fd")))


def _later(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


@pytest.mark.unit
def test_descriptors_go_with_their_message_and_are_the_same_files(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        fdframing.send(a, SetJob(b"job"), [r, w])
        message, fds = fdframing.receive(b)
        assert message == SetJob(b"job") and len(fds) == 2 and not {r, w} & set(fds)
        for mine, theirs in zip((r, w), fds):
            assert os.fstat(mine).st_ino == os.fstat(theirs).st_ino
        os.write(fds[1], b"through the copy")
        assert os.read(r, 100) == b"through the copy"
        for fd in fds:
            os.close(fd)
        fdframing.send(a, JobSet())  # no descriptors: none received
        assert fdframing.receive(b) == (JobSet(), [])
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.unit
def test_more_descriptors_than_a_message_carries_are_refused_by_the_sender(pair):
    a, _ = pair
    with pytest.raises(ValueError, match="at most"):
        fdframing.send(a, JobSet(), [0] * (fdframing.MAX_FDS + 1))


@pytest.mark.unit
def test_a_frame_read_in_pieces_comes_out_whole_with_its_descriptors(pair):
    a, b = pair
    r, w = os.pipe()
    body = fdframing.pickle.dumps(SetJob(b"x" * 1000), protocol=fdframing.pickle.HIGHEST_PROTOCOL)
    frame = fdframing.HEADER.pack(len(body)) + body

    def trickle():  # the header split after its first 3 bytes (the descriptors with them), then a byte at a time
        a.sendmsg([frame[:3]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fdframing.array.array("i", [r]).tobytes())])
        for i in range(3, len(frame), 97):
            time.sleep(0.001)
            a.sendall(frame[i:i + 97])

    t = _later(trickle)
    try:
        message, fds = fdframing.receive(b)
        assert message == SetJob(b"x" * 1000) and len(fds) == 1
        assert os.fstat(fds[0]).st_ino == os.fstat(r).st_ino
        os.close(fds[0])
    finally:
        t.join(WAIT_S)
        os.close(r)
        os.close(w)


@pytest.mark.unit
def test_a_body_larger_than_the_sockets_buffer_arrives_whole(pair):
    a, b = pair
    blob = os.urandom(5 << 20)  # several reads of the body, the sender blocking meanwhile
    t = _later(fdframing.send, a, SetJob(blob))
    message, fds = fdframing.receive(b)
    t.join(WAIT_S)
    assert message.blob == blob and fds == []


@pytest.mark.unit
@pytest.mark.parametrize("cut", ["before", "in_header", "in_body"])
def test_the_other_end_gone_is_eof_and_the_descriptors_of_a_cut_frame_are_closed(pair, cut):
    a, b = pair
    r, w = os.pipe()
    body = fdframing.pickle.dumps(SetJob(b"y" * 100))
    frame = fdframing.HEADER.pack(len(body)) + body
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fdframing.array.array("i", [r]).tobytes())]
    if cut == "in_header":
        a.sendmsg([frame[:4]], anc)
    elif cut == "in_body":
        a.sendmsg([frame[:20]], anc)
    a.close()
    before = _open_fds()
    try:
        with pytest.raises(EOFError):
            fdframing.receive(b)
        assert _open_fds() <= before, "a descriptor that came with a cut frame was left open"
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.unit
def test_sending_to_an_end_that_is_gone_is_an_oserror(pair):
    a, b = pair
    b.close()
    with pytest.raises(OSError):
        fdframing.send(a, SetJob(b"z"))


@pytest.mark.unit
def test_a_frame_that_does_not_unpickle_is_unreadable_and_the_next_one_is_read(pair):
    a, b = pair
    body = b"cno_such_module_here\nThing\n."  # a class this side lacks
    a.sendall(fdframing.HEADER.pack(len(body)) + body)
    fdframing.send(a, JobSet())
    with pytest.raises(fdframing.Unreadable, match="no_such_module_here"):
        fdframing.receive(b)
    assert fdframing.receive(b) == (JobSet(), [])


# -- the two ends --------------------------------------------------------------------------------------------------
class _NotARequest:
    """What a newer kernel might ask: the server does not know it."""


@pytest.fixture
def stand_in():
    """A process for the kernel's end to kill should it give its server up (here the server is a thread)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_the_server_refuses_an_unknown_request_at_once_and_goes_on_serving(pair, stand_in):
    ours, theirs = pair
    loop = forkloop.ForkLoop(theirs, os.getpid())
    served = _later(loop.serve)
    server = forkserver.ForkServer(ours, stand_in, "fresh")
    start = time.monotonic()
    with pytest.raises(forkserver.ForkServerRefused, match="does not know the request _NotARequest"):
        server.request(_NotARequest())
    assert time.monotonic() - start < WAIT_S and not server.gone
    server.set_job(b"the job")  # still serving, in step
    assert loop.job == b"the job"
    ours.shutdown(socket.SHUT_RDWR)  # the kernel gone: the server's loop ends
    served.join(WAIT_S)
    assert not served.is_alive()


def test_a_request_the_server_cannot_read_is_refused_and_the_exchange_stays_in_step(pair, stand_in):
    ours, theirs = pair
    served = _later(forkloop.ForkLoop(theirs, os.getpid()).serve)
    body = b"cno_such_module_here\nThing\n."
    ours.sendall(fdframing.HEADER.pack(len(body)) + body)
    reply, _ = fdframing.receive(ours)
    assert isinstance(reply, Refused) and "cannot read the request" in reply.error
    server = forkserver.ForkServer(ours, stand_in, "fresh")
    server.set_job(b"next")
    ours.shutdown(socket.SHUT_RDWR)
    served.join(WAIT_S)


def test_the_kernel_keeps_the_exits_it_meets_on_the_way_to_its_reply(pair, stand_in):
    ours, theirs = pair
    got = {}

    def server():  # a stand-in server: a rank ended just before the fork was answered
        message, fds = fdframing.receive(theirs)
        got["message"], got["inodes"] = message, [os.fstat(fd).st_ino for fd in fds]
        for fd in fds:
            os.close(fd)
        fdframing.send(theirs, Reaped(pid=123, status=9, peak_rss=4096))
        fdframing.send(theirs, Forked(456), [r])  # (its pidfd: any descriptor stands in for it)
        fdframing.send(theirs, Reaped(pid=456, status=0, peak_rss=8192))

    t = _later(server)
    r, w = os.pipe()
    try:
        kernel = forkserver.ForkServer(ours, stand_in, "fresh")
        forked = kernel.fork(_Spec(rank=1), ("out",), [w])
        assert forked.pid == 456 and os.fstat(forked.pidfd).st_ino == os.fstat(r).st_ino  # the rank's pidfd
        os.close(forked.pidfd)
        t.join(WAIT_S)
        assert got["message"] == Fork(_Spec(rank=1), ("out",)) and got["inodes"] == [os.fstat(w).st_ino]
        assert kernel.exits == {123: (9, 4096)}
        assert kernel.wait_exit(456) == (0, 8192)  # read when asked
        assert kernel.wait_exit(123) == (9, 4096)
    finally:
        os.close(r)
        os.close(w)


def test_a_fork_the_server_refuses_is_raised_naming_the_rank(pair, stand_in):
    ours, theirs = pair

    def server():
        _, fds = fdframing.receive(theirs)
        for fd in fds:
            os.close(fd)
        fdframing.send(theirs, Refused("OSError: no more processes"))

    t = _later(server)
    kernel = forkserver.ForkServer(ours, stand_in, "fresh")
    with pytest.raises(RuntimeError, match="could not start rank 3: OSError: no more processes"):
        kernel.fork(_Spec(rank=3), (), [])
    t.join(WAIT_S)
    assert not kernel.gone


class _Spec:
    def __init__(self, rank):
        self.rank = rank

    def __eq__(self, other):
        return isinstance(other, _Spec) and other.rank == self.rank
