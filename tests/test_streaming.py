"""Every rank's output reaches the cell whole, in order, marked; progress bars redraw; logs keep all."""
import re
from collections import defaultdict

import pytest

from kernel import Kernel

pytestmark = pytest.mark.timeout(180)


def by_rank(text: str) -> dict[int, list[str]]:
    out = defaultdict(list)
    for line in text.splitlines():
        m = re.match(r"\[rank(\d+)\]:(.*)$", line)
        assert m, f"a line without its rank prefix (fragmented?): {line!r}"
        out[int(m.group(1))].append(m.group(2))
    return out


def test_two_ranks_times_100k_lines_arrive_whole_and_in_order(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\nimport sys\nfor i in range(100_000):\n    print(f'line {i} of rank {rank} ' + 'x' * (i % 50))\n",
        timeout=150,
    )
    lines = by_rank(res.stdout)
    for r in (0, 1):
        assert len(lines[r]) == 100_000
        expected = [f"line {i} of rank {r} " + "x" * (i % 50) for i in range(100_000)]
        assert lines[r] == expected


def test_fd_level_c_level_subprocess_and_dataloader_worker_output(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\n"
        "import ctypes, subprocess, sys, torch.utils.data as tud\n"
        "os.write(1, b'fd-level write\\n')\n"
        "ctypes.CDLL(None).printf(b'from C printf %d\\n', rank)\n"
        "subprocess.run(['echo', 'from a subprocess'])\n"
        "print('to stderr', file=sys.stderr)\n"
        "class Loud(tud.Dataset):\n"
        "    def __len__(self): return 2\n"
        "    def __getitem__(self, i):\n"
        "        print(f'worker item {i}', flush=True); return i\n"
        "list(tud.DataLoader(Loud(), num_workers=2, batch_size=1))\n"
        "print('no newline at the end', end='')\n",
        timeout=60,
    )
    out, err = by_rank(res.stdout), by_rank(res.stderr)
    for r in (0, 1):
        assert "fd-level write" in out[r]
        assert f"from C printf {r}" in out[r]
        assert "from a subprocess" in out[r]
        assert {"worker item 0", "worker item 1"} <= set(out[r])
        assert out[r][-1] == "no newline at the end"
        assert "to stderr" in err[r]


TQDM_CELL = (
    "%%ddp --devices 2\nfrom tqdm.auto import tqdm\n"
    "for i in tqdm(range(200), mininterval=0, desc=f'rank {rank}'):\n    pass\n"
    "print('classes', [c.__module__ for c in tqdm.__mro__])\n"
)


@pytest.mark.parametrize("imported_in_kernel", [False, True])
def test_tqdm_redraws_in_place_and_keeps_its_final_state(clean_kernel, imported_in_kernel):
    if imported_in_kernel:  # the notebook already chose tqdm's widget bar for itself
        assert "tqdm.notebook" in clean_kernel.ok("from tqdm.auto import tqdm\nprint(tqdm.__mro__)").stdout
    res = clean_kernel.ok(TQDM_CELL, timeout=60)
    err = by_rank(res.stderr)
    for r in (0, 1):
        bars = [ln for ln in err[r] if "it/s" in ln or "|" in ln]
        assert len(bars) == 1, f"rank {r}: a redrawn bar must be one line, got {len(bars)}"
        assert bars[0].startswith(f"rank {r}: 100%") and "200/200" in bars[0]
    assert "[rank0]:classes" in res.stdout and "tqdm.std" in res.stdout
    assert "tqdm.notebook" not in res.stdout  # the text bar in a rank, never the widget one


def test_ranks_output_zero_without_prefix_and_the_log_keeps_everything(clean_kernel, runs_dir):
    res = clean_kernel.ok("%%ddp --devices 2 --ranks-output 0 --no-prefix\nprint(f'hello from {rank}')\n")
    assert res.stdout.splitlines() == ["hello from 0"]
    run = max(runs_dir.iterdir(), key=lambda p: p.name)
    assert "hello from 1" in (run / "rank1.log").read_text()


# flush_at=10: the pause lets the rank's 50 ms flusher send lines 0-9 as one block that ends exactly at the
# cap (the case that once lost the notice); None: all 100 lines in whatever blocks they come in
@pytest.mark.parametrize("flush_at", [None, 10])
def test_display_cap_sends_the_rest_to_the_log(clean_kernel, runs_dir, flush_at):
    pause = f"\n    if i == {flush_at} - 1:\n        import time; time.sleep(0.3)" if flush_at else ""
    res = clean_kernel.ok(f"%%ddp --devices 2 --max-lines 10\nfor i in range(100):\n    print(i){pause}\n")
    lines = by_rank(res.stdout)
    assert lines[0][:10] == [str(i) for i in range(10)]
    assert len(lines[0]) == 11 and "the rest is only in the log" in lines[0][10]
    run = max(runs_dir.iterdir(), key=lambda p: p.name)
    assert (run / "rank0.log").read_text().split() == [str(i) for i in range(100)]


def test_dashboard_widget_while_running_then_static_summary(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\nimport time\nprint(f'working on rank {rank}', flush=True)\n"
        "x = torch.zeros(10_000_000)  # 40 MB of this rank's own\n"
        "time.sleep(2.5)\n",
        timeout=60,
    )
    widget_states = [c["data"].get("state", {}).get("value", "") for c in res.comms]
    live = [v for v in widget_states if "USS (private)" in v]
    assert live, "the live dashboard widget was never updated"
    last_live = live[-1]
    assert "working on rank 0" in last_live and "working on rank 1" in last_live
    assert re.search(r">running<", last_live)
    assert any("application/vnd.jupyter.widget-view+json" in d["data"] for d in res.displays)
    final = res.displays[-1]
    assert final["transient"]["display_id"] == res.displays[0]["transient"]["display_id"]
    html, text = final["data"]["text/html"], final["data"]["text/plain"]
    assert "peak RSS" in html and html.count(">finished<") == 2
    assert re.search(r"nbddp · 2 ranks · cpu/gloo · finished · \d+\.\d s", text)
    assert re.search(r"^1\s+cpu\s+finished\s+0\s+\d+\.\d s\s+\d+ MB\s+\d+ MB", text, re.M)
    assert "logs: " in text


def test_failed_run_summary_shows_states(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2\nimport time\nif rank == 1:\n    raise ValueError('x')\ntime.sleep(30)\n")
    text = res.displays[-1]["data"]["text/plain"]
    assert "· failed ·" in text
    assert re.search(r"^0\s+cpu\s+stopped\s+SIGTERM", text, re.M)
    assert re.search(r"^1\s+cpu\s+failed\s+1\b", text, re.M)


def test_logging_handler_made_in_the_notebook_writes_to_the_ranks_stderr(clean_kernel):
    k = clean_kernel
    k.ok("import logging\nlog = logging.getLogger('train')\nlog.addHandler(logging.StreamHandler())  # the kernel's stderr\n"
         "log.setLevel(logging.INFO)\nlog.propagate = False")
    res = k.ok("%%ddp --devices 2\nlog.info(f'epoch 1 done on rank {rank}')\n")
    err = by_rank(res.stderr)
    assert err[0] == ["epoch 1 done on rank 0"] and err[1] == ["epoch 1 done on rank 1"]


CUT = "... [line cut at 10000 characters (--max-line-chars): all of it is in rank{r}.log in the run directory]"


def test_a_long_line_is_shown_cut_with_a_note_and_the_log_keeps_it_whole(clean_kernel, runs_dir):
    """5 MB lines, one ended and one that never ends: each rank shows each cut once, whole and prefixed
    (not 1 MB pieces interleaved across ranks); the log has every byte."""
    res = clean_kernel.ok("%%ddp --devices 2\nimport sys\nsys.stdout.write('x' * 5_000_000 + '\\n')\n"
                          "print('after')\nsys.stdout.write('y' * 5_000_000)\n", timeout=120)
    out = by_rank(res.stdout)
    for r in (0, 1):
        assert out[r] == ["x" * 10_000 + " " + CUT.format(r=r), "after", "y" * 10_000 + " " + CUT.format(r=r)]
    assert len(res.stdout) < 50_000
    run = max(runs_dir.iterdir(), key=lambda p: p.name)
    assert (run / "rank1.log").read_text() == "x" * 5_000_000 + "\nafter\n" + "y" * 5_000_000


LONG_LINES = "for i in range(1000):\n    print(f'{i:04d} ' + 'z' * 95)\n"  # 101 characters a line


def check_output_cap(res):
    lines = by_rank(res.stdout)
    for r in (0, 1):  # 0.01 MiB = 10485 characters: 103 whole lines fit
        assert lines[r][:103] == [f"{i:04d} " + "z" * 95 for i in range(103)]
        assert lines[r][103:] == [f"... more output than --max-output-mb 0.01: the rest is only in the log "
                                  f"(rank{r}.log in the run directory)"]


def test_output_per_rank_is_capped_in_bytes_too(clean_kernel):
    check_output_cap(clean_kernel.ok("%%ddp --devices 2 --max-output-mb 0.01\n" + LONG_LINES))


def test_a_line_that_never_ends_keeps_the_relays_memory_bounded():
    """Through the relay itself: 64 MB of one line, 64 KiB at a time, hold at most a cap's worth."""
    from nbddp.views.relay import MAX_PARTIAL, Relay
    from nbddp.kernel.supervisor import Output, OutputClosed

    class Sink:
        def __init__(self):
            self.written = []

        def write(self, stream, text, rank=None):
            self.written.append(text)

        def close(self):
            pass

    for cap, pieces in ((10_000, 1), (10_000_000, None)):  # a cap beyond MAX_PARTIAL: shown in bounded pieces
        sink = Sink()
        relay = Relay(sink, ranks_output="all", prefix=True, max_lines=10**9, max_line_chars=cap, max_output_mb=10**6)
        biggest = 0
        for _ in range(1024):
            relay.on_Output(Output(0, "stdout", b"w" * 65536))
            biggest = max(biggest, sum(map(len, relay._partial.values())))
        relay.on_Output(Output(0, "stdout", b"w\nnext\n"))
        relay.on_OutputClosed(OutputClosed(0, "stdout"))
        assert biggest <= min(MAX_PARTIAL, 4 * cap + 4)
        if pieces:
            assert sink.written[0].startswith("[rank0]:" + "w" * cap + " ... [line cut at")
            assert sink.written[1:] == ["[rank0]:next\n"]
        else:
            assert len(sink.written) >= 60 and sink.written[-1].endswith("w\n[rank0]:next\n")


def test_a_long_redrawn_line_keeps_only_its_latest_state(clean_kernel):
    """3 MB of carriage-return redraws without a newline: one final line, never cut into pieces."""
    res = clean_kernel.ok(
        "%%ddp --devices 2\nimport sys\nfor i in range(100_000):\n"
        "    sys.stderr.write(f'\\rprogress {i:06d} ' + 'x' * 20)\nsys.stderr.write('\\n')\n",
        timeout=120,
    )
    err = by_rank(res.stderr)
    for r in (0, 1):
        assert err[r] == ["progress 099999 " + "x" * 20]


# -- issue 11: a %%ddp cell's output behaves like a notebook cell's ----------------------------------
@pytest.fixture
def pool(clean_kernel):
    """The module kernel with a 2-rank pool, stopped after the test."""
    assert "ready" in clean_kernel.ok("%ddp start --devices 2").stdout
    yield clean_kernel
    clean_kernel.ok("%ddp stop")


BOUND = {  # how the notebook bound tqdm before the cell -> how the cell calls it
    "from tqdm.auto import tqdm": "tqdm",
    "from tqdm.notebook import tqdm": "tqdm",
    "import tqdm.auto as ta": "ta.tqdm",
}
FROZEN = re.compile(r"\| 0/30")  # a widget bar's text form, never updated after its first draw


def check_final_bars(res, total=30, descs=("rank {r}",)):
    err = by_rank("".join(ln for ln in res.stderr.splitlines(True) if not ln.startswith("nbddp: sent ")))
    for r in (0, 1):
        for desc in descs:
            bars = [ln for ln in err[r] if ln.startswith(desc.format(r=r) + ":")]
            assert len(bars) == 1, f"rank {r}: one line per bar, its final state; got {err[r]}"
            assert bars[0].startswith(desc.format(r=r) + ": 100%") and f"{total}/{total}" in bars[0], bars[0]
    assert not any(FROZEN.search(d["data"].get("text/plain", "")) for d in res.displays)


@pytest.mark.parametrize("bound", list(BOUND))
def test_a_tqdm_name_bound_before_the_cell_draws_a_live_text_bar(clean_kernel, bound):
    clean_kernel.ok(bound)
    res = clean_kernel.ok(f"%%ddp --devices 2\nfor i in {BOUND[bound]}(range(30), desc=f'rank {{rank}}'):\n    pass\n")
    check_final_bars(res)


def test_the_dashboard_shows_each_ranks_bar_as_its_last_line(clean_kernel):
    clean_kernel.ok("from tqdm.auto import tqdm")
    res = clean_kernel.ok("%%ddp --devices 2\nimport time\nprint('training', flush=True)\n"
                          "for i in tqdm(range(30), desc=f'rank {rank}'):\n    time.sleep(0.1)\n", timeout=60)
    check_final_bars(res)
    values = [c["data"].get("state", {}).get("value", "") for c in res.comms]
    live = [v for v in values if "USS (private)" in v]
    assert live, "the live dashboard widget was never updated"
    bar = r"rank {}: +\d+%\|[^<]*\| ?\d+/30"
    assert any(re.search(bar.format(0), v) and re.search(bar.format(1), v) for v in live), live[-1]


def test_pool_ranks_draw_text_bars_for_tqdm_imported_after_the_start(runs_dir):
    """A fresh kernel: the pool's ranks are forked before tqdm exists; the notebook imports it after, and
    the cell's bars (names sent to the ranks, imported there) still draw as text."""
    k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)})
    try:
        k.ok("%load_ext nbddp")
        k.ok("%ddp start --devices 2")
        k.ok("from tqdm.notebook import tqdm as nb_bar, trange\nfrom tqdm.auto import tqdm as auto_bar")
        res = k.ok("%%ddp\nfor i in nb_bar(range(30), desc=f'nb {rank}'):\n    pass\n"
                   "for i in auto_bar(range(30), desc=f'auto {rank}'):\n    pass\n"
                   "for i in trange(30, desc=f'trange {rank}', display=False):\n    pass\n")
        check_final_bars(res, descs=("nb {r}", "auto {r}", "trange {r}"))
        k.ok("%ddp stop")
    finally:
        k.shutdown()


def test_a_bar_the_kernel_is_drawing_at_the_fork_does_not_block_the_ranks_bars(clean_kernel):
    """tqdm's lock, held by another kernel thread at the fork (a bar mid-draw there), is not the ranks'."""
    k = clean_kernel
    k.ok("import threading\nfrom tqdm.auto import tqdm\nheld, done = threading.Event(), threading.Event()\n"
         "def hold():\n    with tqdm.get_lock():\n        held.set()\n        done.wait()\n"
         "threading.Thread(target=hold, daemon=True).start()\nassert held.wait(10)")
    try:
        res = k.run("%%ddp --devices 2 --timeout 20\nfor i in tqdm(range(30), desc=f'rank {rank}'):\n    pass\n",
                    timeout=60)
        assert res.error is None, res.error_text
        check_final_bars(res)
    finally:
        k.ok("done.set()")


ALTERNATING = ("%%ddp --devices 2\nimport sys\nprint('loading', end='')\nprint('warned', file=sys.stderr)\n"
               "print(' done')\nfor i in range(50):\n    print(f'out {i}')\n    print(f'err {i}', file=sys.stderr)\n")
ALTERNATED = [("stdout", "loading"), ("stderr", "warned"), ("stdout", " done")] + [
    (name, f"{name[3:]} {i}") for i in range(50) for name in ("stdout", "stderr")]


def stream_order(k, code: str) -> dict[int, list]:
    """Each rank's lines as the front end received them, in order, with the stream each came on."""
    seen = []

    def watch(kind, content):
        if kind == "stream":
            seen.append((content["name"], content["text"]))

    res = k.collect(k.execute(code), 60, on_message=watch)
    assert res.error is None, res.error_text
    order = defaultdict(list)
    for name, text in seen:
        for line in text.splitlines():
            m = re.match(r"\[rank(\d+)\]:(.*)$", line)
            if m:
                order[int(m.group(1))].append((name, m.group(2)))
    return order


def test_stdout_and_stderr_keep_the_order_the_rank_wrote_them(clean_kernel):
    order = stream_order(clean_kernel, ALTERNATING)
    assert order[0] == ALTERNATED and order[1] == ALTERNATED


def test_stdout_and_stderr_keep_their_order_in_a_pool(pool):
    order = stream_order(pool, ALTERNATING.replace(" --devices 2", ""))
    assert order[0] == ALTERNATED and order[1] == ALTERNATED


def test_line_and_output_caps_in_a_pool(pool):
    check_output_cap(pool.ok("%%ddp --max-output-mb 0.01\n" + LONG_LINES))
    out = by_rank(pool.ok("%%ddp --max-line-chars 10\nprint('a' * 20)\nprint('b' * 10)\n").stdout)
    cut = CUT.replace("10000", "10")
    assert out[0] == ["a" * 10 + " " + cut.format(r=0), "b" * 10] and out[1][0].startswith("a" * 10 + " ... [line cut")


def test_the_order_budget_allows_a_burst_then_a_rate():
    from nbddp.wire.budget import Budget

    b = Budget(burst=3, rate=1000.0)
    assert [b.take() for _ in range(3)] == [True] * 3
    b.since -= 0.0005  # half a token's worth of time since the last refill
    assert not b.take()
    b.since -= 0.01  # ten tokens' worth: refilled up to the burst only
    assert [b.take() for _ in range(4)] == [True, True, True, False]


def test_torchs_own_rank_prefix_is_not_doubled():
    """torch prefixes its C++ warnings with "[rankN]:" itself: the cell shows one, not "[rank1]:[rank1]:"."""
    from nbddp.kernel.supervisor import Output
    from nbddp.views.relay import Relay

    written = []

    class Sink:
        def write(self, stream, text, rank=None):
            written.append(text)

        def close(self):
            pass

    relay = Relay(Sink(), ranks_output="all", prefix=True, max_lines=100, max_line_chars=1000, max_output_mb=1)
    relay.on_Output(Output(1, "stderr", b"[rank1]:[W reducer.cpp:1430] Warning: unused parameters\nplain\n"))
    relay.on_Output(Output(0, "stdout", b"[rank1]:quoted by rank 0\n"))  # another rank's tag is text: kept
    assert written == ["[rank1]:[W reducer.cpp:1430] Warning: unused parameters\n[rank1]:plain\n",
                       "[rank0]:[rank1]:quoted by rank 0\n"]
