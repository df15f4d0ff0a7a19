"""The typed channel and the option defaults, without a kernel: framing that no byte can confuse, one
source of defaults, IPython's own names told from the notebook's."""
import pickle

import pytest

from nbddp.kernel.names.sending import ship_globals
from nbddp.wire import framing, messages

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)


def test_frames_survive_any_split_and_lengths_whose_bytes_look_like_markers():
    # payload lengths whose little-endian first byte is 0x01 (the old one-byte "ready" marker)
    records = [messages.Ready()] + [messages.Error("group", "RuntimeError", "x" * n, "", 1.0) for n in range(150, 700)]
    stream = b"".join(framing.encode(r) for r in records)
    assert any(framing.encode(r)[len(framing.MAGIC)] == 1 for r in records)
    for step in (1, 7, 4096):
        reader = framing.Reader()
        got = []
        for i in range(0, len(stream), step):
            got += [rec for rec, _ in reader.feed(stream[i : i + step])]
        assert got == records and reader.pending == 0


def test_a_reader_that_starts_in_the_middle_of_a_frame_finds_the_next_one():
    """A kept pool's channel, read by its keeper from wherever the dead kernel had read it to: the rest of a frame
    is skipped, never read as a length (a length read from the middle of a pickle would wait for ever)."""
    records = [messages.Error("cell", "E", "x" * n, "", 1.0) for n in (10, 5000, 70_000, 3)]
    stream = b"".join(framing.encode(r) for r in records)
    first = len(framing.encode(records[0]))
    for cut in (1, 4, 5, 28, 29, first - 1, first + 100):
        reader = framing.Reader()
        got = []
        for i in range(cut, len(stream), 4096):
            got += [rec for rec, _ in reader.feed(stream[i : i + 4096])]
        whole = [r for r in records if stream.find(framing.encode(r)) >= cut]
        assert got == whole and reader.pending == 0, (cut, len(got))
        assert reader.skipped == stream.find(framing.encode(whole[0])) - cut


def test_each_frame_carries_the_ranks_stdout_and_stderr_marks():
    frame = framing.encode(messages.Done(), (123, 45))
    assert framing.Reader().feed(frame) == [(messages.Done(), (123, 45))]


def test_a_record_the_kernel_cannot_unpickle_becomes_an_error_record():
    payload = b"\x80\x05not a pickle"
    got = [rec for rec, _ in framing.Reader().feed(framing.HEADER.pack(framing.MAGIC, len(payload), 0, 0) + payload)]
    assert isinstance(got[0], messages.Error) and "cannot be unpickled in the kernel" in got[0].message


def test_every_phase_has_words_and_records_pickle():
    assert set(messages.PHASES) >= {"start", "job", "threads", "device", "group", "cell", "results", "leave"}
    for rec in (messages.Display({"text/plain": "x"}), messages.ClearOutput(True), messages.Done(),
                messages.Exit(0, "", "cell", 1.0), messages.Result(messages.Item(b"x"))):
        assert pickle.loads(pickle.dumps(rec)) == rec


def test_launch_rejects_unknown_options_before_starting_anything():
    import nbddp

    with pytest.raises(nbddp.UsageError, match="unknown option.*devicez.*the options are: devices"):
        nbddp.launch(print, devicez=2)


def test_spawn_ships_notebook_names_that_merely_start_with_underscore_i():
    ns = {"_idx": [1, 2], "_images": "x", "_i": "ipython", "_i3": "ipython", "_ii": "ipython", "_7": 1}
    shipped = ship_globals("print(_idx, _images, _i, _i3, _ii, _7)\n", "<cell>", ns)
    assert sorted(shipped) == ["_idx", "_images"]
