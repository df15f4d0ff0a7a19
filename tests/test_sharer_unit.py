"""The Sharer's cache and the memfds under it (wire/sharedtensor.py, wire/memfd.py) without a kernel: what a
send copies, what it finds again, and what a reader rebuilds. The reader here is this process (it opens its
own memfd through /proc, as a rank opens the kernel's), or a plain subprocess where another process matters."""
import errno
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest

from nbddp.wire import memfd, sharedtensor, values

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not memfd.available(), reason="memfds and /proc (Linux)")
N = 1 << 16  # floats: 256 KiB, over MIN_BYTES


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _send(*objs):
    """One send of ``objs``: (each one's reduction, bytes copied into an arena, bytes shared)."""
    with sharedtensor.sharer().send() as sharer:
        reduced = [sharedtensor.reduce(o) for o in objs]
        return reduced, sharer.copied, sharer.shared


def _place(reduced):
    """(handle, offset) of a reduction through an arena."""
    _, (handle, offset, _) = reduced
    return handle, offset


@pytest.mark.unit
def test_an_unchanged_tensor_sends_only_its_handle_again():
    t = torch.arange(N, dtype=torch.float32)
    (first,), copied, shared = _send(t)
    assert first[0] is sharedtensor._tensor and copied == shared == t.untyped_storage().nbytes()
    (again,), copied, shared = _send(t)
    assert copied == 0 and shared == t.untyped_storage().nbytes()
    assert _place(again) == _place(first)


@pytest.mark.unit
def test_a_tensor_changed_in_place_or_rebound_is_copied_anew_and_read_as_it_is_now():
    t = torch.arange(N, dtype=torch.float32)
    (first,), _, _ = _send(t)
    t.add_(1)  # its version counter moves
    (changed,), copied, _ = _send(t)
    assert copied == t.untyped_storage().nbytes() and _place(changed) != _place(first)
    rebuilt = changed[0](*changed[1])
    assert torch.equal(rebuilt, t)
    t = torch.arange(N, dtype=torch.float32)  # rebound to equal values: another object, copied again
    (rebound,), copied, _ = _send(t)
    assert copied == t.untyped_storage().nbytes()


@pytest.mark.unit
def test_views_of_one_storage_share_one_copy():
    base = torch.arange(N, dtype=torch.float32)
    half, strided = base[N // 2:], base[::2]
    reduced, copied, shared = _send(base, half, strided)
    nbytes = base.untyped_storage().nbytes()
    assert copied == nbytes and shared == 3 * nbytes
    assert len({_place(r) for r in reduced}) == 1
    for view, r in zip((base, half, strided), reduced):
        assert torch.equal(r[0](*r[1]), view)
    (again,), copied, _ = _send(half)  # a view sent on its own later: still the one copy
    assert copied == 0 and _place(again) == _place(reduced[0])


@pytest.mark.unit
def test_a_tensors_attributes_come_with_it_as_torchs_pickling_keeps_them():
    weight = torch.nn.Parameter(torch.ones(N))
    weight._is_hf_initialized, weight.tag = True, {"layer": 3}
    plain = torch.zeros(N)
    plain.note = "x"
    (w, p), _, _ = _send(weight, plain)
    got, other = w[0](*w[1]), p[0](*p[1])
    assert type(got) is torch.nn.Parameter and got._is_hf_initialized is True and got.tag == {"layer": 3}
    assert other.note == "x" and torch.equal(other, plain)


def test_what_a_reader_rebuilds_is_its_own_the_notebooks_value_and_other_readers_keep_theirs():
    t = torch.zeros(N)
    blob = values.to_ranks(t)
    assert len(blob) < 4096  # a handle, not the bytes
    mine = pickle.loads(blob)
    mine.add_(5)  # a private mapping: the pages it touches are copied
    assert float(t.sum()) == 0 and float(mine[0]) == 5
    read = "import pickle, sys; print(float(pickle.loads(sys.stdin.buffer.read()).sum()))"
    other = subprocess.run([sys.executable, "-c", read], input=blob, capture_output=True, timeout=120, env=_env())
    assert other.stdout.split() == [b"0.0"], other.stderr  # another reader (a rank) maps the arena as it was sent


@pytest.mark.unit
def test_an_array_changed_in_place_is_seen_and_copied_anew():
    a = np.arange(N, dtype=np.float32)
    (first,), copied, _ = _send(a)
    assert first[0] is sharedtensor._array and copied == a.nbytes
    assert not sharedtensor.changed_array(a)
    (again,), copied, _ = _send(a)
    assert copied == 0 and _place(again) == _place(first)
    a[7] = -1  # no version counter: its bytes are compared with the arena's copy
    assert sharedtensor.changed_array(a)
    (changed,), copied, _ = _send(a)
    assert copied == a.nbytes and _place(changed) != _place(first)
    assert not sharedtensor.changed_array(a)
    assert np.array_equal(changed[0](*changed[1]), a)
    assert not sharedtensor.changed_array(np.arange(N, dtype=np.float32))  # never sent: not "changed"


@pytest.mark.unit
def test_small_values_and_values_for_another_machine_are_pickled_as_they_are():
    assert _send(torch.zeros(16))[0] == [None]
    big = torch.zeros(N)
    with memfd.elsewhere():
        assert _send(big)[0] == [None]
        with memfd.elsewhere(False):  # never turned off inside a sender that turned it on
            assert memfd.going_elsewhere()
    assert not memfd.going_elsewhere()
    assert _send(big)[0] != [None]


@pytest.mark.unit
def test_where_values_go_is_each_threads_own():
    inside, seen = threading.Event(), []

    def other_sender():
        seen.append(memfd.going_elsewhere())

    with memfd.elsewhere():
        inside.set()
        t = threading.Thread(target=other_sender)
        t.start()
        t.join()
        assert memfd.going_elsewhere()
    assert seen == [False]  # a background cell's thread pickling at the same time is not affected


@pytest.mark.unit
def test_reserving_memory_that_is_not_there_is_shared_memory_full_saying_the_size(monkeypatch):
    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(sharedtensor.SharedMemoryFull, match="256 KiB"):
        _send(torch.ones(N))


def test_another_process_opens_a_memfd_by_its_handle_and_a_replaced_one_is_told():
    fd = memfd.create("nbddp-test")
    os.write(fd, b"hello")
    handle = memfd.handle(fd)
    assert handle.pid == os.getpid() and handle.key == (memfd.boot_id(), os.fstat(fd).st_ino)
    code = textwrap.dedent("""
        import os, pickle, sys
        from nbddp.wire import memfd
        h = pickle.loads(bytes.fromhex(sys.argv[1]))
        try:
            fd = memfd.open_handle(h)
        except memfd.Replaced:
            print("replaced")
        except memfd.Unreachable:
            print("unreachable")
        else:
            print(os.read(fd, 5).decode())
    """)

    def opened(h) -> str:
        out = subprocess.run([sys.executable, "-c", code, pickle.dumps(h).hex()], capture_output=True, text=True,
                             timeout=60, env=_env())
        return out.stdout.strip() or out.stderr

    try:
        assert opened(handle) == "hello"
        other = memfd.create("nbddp-test-other")
        try:
            assert opened(handle._replace(inode=os.fstat(other).st_ino)) == "replaced"  # as if let go, then reused
        finally:
            os.close(other)
        assert opened(handle._replace(boot="another-machine")) == "unreachable"
        assert opened(handle._replace(fd=None)) == "unreachable"
    finally:
        os.close(fd)
    assert opened(handle) in ("unreachable", "replaced")  # let go: the number holds nothing, or something else
