"""The typed channel and the option defaults, without a kernel: framing that no byte can confuse, one
source of defaults, IPython's own names told from the notebook's."""
import dataclasses
import pickle

import pytest

from nbddp import channel, launcher
from nbddp.cell import ship_globals


def test_frames_survive_any_split_and_lengths_whose_bytes_look_like_markers():
    # payload lengths whose little-endian first byte is 0x01 (the old one-byte "ready" marker)
    records = [channel.Ready()] + [channel.Error("group", "RuntimeError", "x" * n, "", 1.0) for n in range(150, 700)]
    stream = b"".join(channel.encode(r) for r in records)
    assert any(channel.encode(r)[0] == 1 for r in records)
    for step in (1, 7, 4096):
        reader = channel.Reader()
        got = []
        for i in range(0, len(stream), step):
            got += [rec for rec, _ in reader.feed(stream[i : i + step])]
        assert got == records and reader.pending == 0


def test_each_frame_carries_the_ranks_stdout_and_stderr_marks():
    frame = channel.encode(channel.Done(), (123, 45))
    assert channel.Reader().feed(frame) == [(channel.Done(), (123, 45))]


def test_a_record_the_kernel_cannot_unpickle_becomes_an_error_record():
    payload = b"\x80\x05not a pickle"
    got = [rec for rec, _ in channel.Reader().feed(channel.HEADER.pack(len(payload), 0, 0) + payload)]
    assert isinstance(got[0], channel.Error) and "cannot be unpickled in the kernel" in got[0].message


def test_every_phase_has_words_and_records_pickle():
    assert set(channel.PHASES) >= {"start", "job", "threads", "device", "group", "cell", "results", "leave"}
    for rec in (channel.Display({"text/plain": "x"}), channel.ClearOutput(True), channel.Done(),
                channel.Exit(0, "", "cell", 1.0), channel.Result(channel.Item(b"x"))):
        assert pickle.loads(pickle.dumps(rec)) == rec


def test_config_is_the_one_source_of_defaults_and_keyword_only():
    with pytest.raises(TypeError):
        launcher.Config("auto")  # positional options were how launch() once drifted from the magic
    from nbddp.magic import DDPMagics

    parser = DDPMagics.ddp.parser
    for f in dataclasses.fields(launcher.Config):
        dest = {"prefix": "no_prefix"}.get(f.name, f.name)
        default = parser.get_default(dest)
        expected = (not f.default) if f.name == "prefix" else f.default
        assert default == expected, (f.name, default, f.default)


def test_launch_rejects_unknown_options_before_starting_anything():
    import nbddp

    with pytest.raises(nbddp.UsageError, match="unknown option.*devicez.*the options are: devices"):
        nbddp.launch(print, devicez=2)


def test_spawn_ships_notebook_names_that_merely_start_with_underscore_i():
    ns = {"_idx": [1, 2], "_images": "x", "_i": "ipython", "_i3": "ipython", "_ii": "ipython", "_7": 1}
    shipped = ship_globals("print(_idx, _images, _i, _i3, _ii, _7)\n", "<cell>", ns)
    assert sorted(shipped) == ["_idx", "_images"]
