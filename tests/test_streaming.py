"""Every rank's output reaches the cell whole, in order, marked; progress bars redraw; logs keep all."""
import re
from collections import defaultdict

import pytest

from kernel import Kernel

pytestmark = pytest.mark.timeout(180)


def ranks_of(span: str) -> list[int]:
    """The ranks a line's label names: "1" -> [1], "0-2,5" -> [0, 1, 2, 5] (identical lines merged)."""
    out = []
    for part in span.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def by_rank(text: str) -> dict[int, list[str]]:
    """Each rank's lines; a merged line ([rank0-1]:) counts for each of its ranks."""
    out = defaultdict(list)
    for line in text.splitlines():
        m = re.match(r"\[rank([\d,-]+)\]:(.*)$", line)
        assert m, f"a line without its rank prefix (fragmented?): {line!r}"
        for r in ranks_of(m.group(1)):
            out[r].append(m.group(2))
    return out


def test_two_ranks_times_100k_lines_arrive_whole_and_in_order(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\nimport sys\nfor i in range(100_000):\n"
        "    print(f'line {i} of rank {rank} ' + 'x' * (i % 50))\n",
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
def test_tqdm_draws_a_live_bar_per_rank_kept_at_its_final_state_and_the_log_keeps_the_text(clean_kernel, runs_dir,
                                                                                           imported_in_kernel):
    if imported_in_kernel:  # the notebook already chose tqdm's widget bar for itself
        assert "tqdm.notebook" in clean_kernel.ok("from tqdm.auto import tqdm\nprint(tqdm.__mro__)").stdout
    res = clean_kernel.ok(TQDM_CELL, timeout=60)
    check_final_bars(res, total=200)
    assert by_rank(res.stdout)[0][0].startswith("classes") and "tqdm.std" in res.stdout
    assert "tqdm.notebook" not in res.stdout  # the text bar in a rank, never the widget one
    run = max(runs_dir.iterdir(), key=lambda p: p.name)
    for r in (0, 1):
        assert f"rank {r}: 100%" in (run / f"rank{r}.log").read_text(), "the log keeps the text bar"


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


def dashboard_states(seq) -> tuple[str, list[dict]]:
    """The dashboard's display id and every state it was drawn in (first, updates), in order."""
    first = next(c for kind, c in seq if kind == "display_data" and "nbddp-run" in c["data"].get("text/html", ""))
    did = first["transient"]["display_id"]
    return did, [c["data"] for kind, c in seq if kind in ("display_data", "update_display_data")
                 and c.get("transient", {}).get("display_id") == did]


def run_seq(k, code, timeout=60):
    seq = []
    res = k.collect(k.execute(code), timeout, on_message=lambda kind, c: seq.append((kind, c)))
    return res, seq


def test_the_dashboard_sits_above_the_stream_and_updates_in_place_to_its_final_state(clean_kernel):
    res, seq = run_seq(clean_kernel, "%%ddp --devices 2\nimport time\nprint(f'working on rank {rank}', flush=True)\n"
                       "x = torch.zeros(10_000_000)  # 40 MB of this rank's own\ntime.sleep(2.5)\n")
    assert res.error is None, res.error_text
    outputs = [(kind, c) for kind, c in seq if kind in ("stream", "display_data")]
    assert outputs[0][0] == "display_data" and "nbddp-run" in outputs[0][1]["data"]["text/html"], outputs[:2]
    assert [kind for kind, _ in outputs].count("display_data") == 1, "one slot, updated in place"
    _, states = dashboard_states(seq)
    live = [s["text/plain"] for s in states if "· running ·" in s["text/plain"]]
    assert live and "working on rank 0" in live[-1] and "working on rank 1" in live[-1], states
    final = states[-1]
    html, text = final["text/html"], final["text/plain"]
    assert "white-space:nowrap" in html and len(re.findall(r"^\d\s+finished\s", text, re.MULTILINE)) == 2, text
    assert re.search(r"nbddp · 2 ranks · cpu/gloo · finished · \d+\.\d s", text)
    assert re.search(r"^1\s+finished\s+\d+\.\d s\s+[\d.]+ MiB\s+working on rank 1$", text, re.MULTILINE), text
    # one table, live and final: the same columns, nothing empty
    header = [ln for ln in text.splitlines() if ln.startswith("rank ")]
    assert header[0].split() == ["rank", "state", "time", "private", "memory", "last", "line"], header
    assert live[-1].splitlines()[1].split() == header[0].split(), "the live table has the final one's columns"
    assert "logs: " in text
    # the run directory on the title's hover; shown in the view only once a cell failed or was interrupted
    assert re.search(r"<div title='logs: /[^']+'><b>nbddp</b>", html) and ">logs: " not in html, html
    assert re.search(r"(?s)^<div class='nbddp-run'.*?</div></div>$", html), "the view ends at its only </div></div>"


def test_a_failed_rank_shows_its_exception_and_a_rank_done_before_it_shows_finished(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 3\nimport time\nif rank == 1:\n    time.sleep(1.5)\n"
                           "    raise ValueError('x went wrong')\nif rank == 2:\n    time.sleep(30)\nprint('done')\n")
    text = res.displays[-1]["data"]["text/plain"]
    assert "· failed ·" in text
    assert re.search(r"^0\s+finished\s.*done$", text, re.MULTILINE), text  # its work was over before rank 1 failed
    assert re.search(r"^1\s+failed\s.*ValueError: x went wrong$", text, re.MULTILINE), text
    assert re.search(r"^2\s+stopped\s", text, re.MULTILINE), text
    html = res.displays[-1]["data"]["text/html"]
    assert ">logs: /" in html, "a failed cell shows where the rest of its output is"
    assert re.search(r"(?s)^<div class='nbddp-run'.*?</div></div>$", html), "the view ends at its only </div></div>"


def test_the_last_line_keeps_its_start_and_skips_stack_dumps(clean_kernel):
    """A long log dict keeps its first keys; an interrupt's faulthandler dump is not a rank's last line."""
    k = clean_kernel
    res = k.interrupt_when("%%ddp --devices 2\nimport time\n"
                           "print({'loss': 0.25, **{f'metric_{i}': i for i in range(40)}}, flush=True)\n"
                           "time.sleep(60)\n", "{'loss'", 2)
    assert res.error and res.error["ename"] == "KeyboardInterrupt", res.error_text
    text = res.displays[-1]["data"]["text/plain"]
    assert "· interrupted ·" in text
    rows = [ln for ln in text.splitlines() if re.match(r"\d\s", ln)]
    assert len(rows) == 2 and all("{'loss': 0.25, 'metric_0': 0" in ln for ln in rows), text
    assert 'File "' not in text and "Thread 0x" not in text


def test_logging_handler_made_in_the_notebook_writes_to_the_ranks_stderr(clean_kernel):
    k = clean_kernel
    k.ok("import logging\nlog = logging.getLogger('train')\nlog.addHandler(logging.StreamHandler())  # the kernel's "
         "stderr\n"
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
        note = (f"... more output than --max-output-mb 0.01: the rest is only in the log (rank{r}.log in the run "
                "directory)")
        assert lines[r][103:] == [note]


def test_output_per_rank_is_capped_in_bytes_too(clean_kernel):
    check_output_cap(clean_kernel.ok("%%ddp --devices 2 --max-output-mb 0.01\n" + LONG_LINES))


@pytest.mark.unit
def test_a_line_that_never_ends_keeps_the_relays_memory_bounded():
    """Through the relay itself: 64 MB of one line, 64 KiB at a time, hold at most a cap's worth."""
    from nbddp.kernel.ranks.supervisor import Output, OutputClosed
    from nbddp.views.relay import MAX_PARTIAL, Relay

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
BOUND = {  # how the notebook bound tqdm before the cell -> how the cell calls it
    "from tqdm.auto import tqdm": "tqdm",
    "from tqdm.notebook import tqdm": "tqdm",
    "import tqdm.auto as ta": "ta.tqdm",
}
FROZEN = re.compile(r"\| 0/30")  # a widget bar's text form, never updated after its first draw


def check_final_bars(res, total=30, descs=("rank {r}",)):
    """One output per bar, every rank's row in it in rank order, at 100 % in the end, labelled with its rank;
    no text bar in the stream."""
    bars = list(res.bar_states.values())
    assert len(bars) == len(descs), f"one output per bar (every rank's row in it): {bars}"
    for desc in descs:
        mine = [b for b in bars if f":{desc.format(r=0)}:" in b["text/plain"]]
        assert len(mine) == 1, f"{desc}: one output, its final state; got {bars}"
        rows = mine[0]["text/plain"].splitlines()
        for r, row in zip((0, 1), rows, strict=True):  # in rank order
            head = f"[rank{r}]:{desc.format(r=r)}:"
            assert row.startswith(head + " 100%") and f"{total}/{total}" in row, rows
        assert mine[0]["text/html"].count("class='nbddp-bar'") == 2 and mine[0]["text/html"].count("width:100%") == 2
    assert not [ln for ln in res.stderr.splitlines() if "%|" in ln], res.stderr
    assert not any(FROZEN.search(d["data"].get("text/plain", "")) for d in res.displays if "-bar" not in
                   d.get("transient", {}).get("display_id", ""))


@pytest.mark.parametrize("bound", list(BOUND))
def test_a_tqdm_name_bound_before_the_cell_draws_a_live_text_bar(clean_kernel, bound):
    clean_kernel.ok(bound)
    res = clean_kernel.ok(f"%%ddp --devices 2\nfor i in {BOUND[bound]}(range(30), desc=f'rank {{rank}}'):\n    pass\n")
    check_final_bars(res)


def test_the_dashboard_shows_each_ranks_progress_and_bar(clean_kernel):
    clean_kernel.ok("from tqdm.auto import tqdm")
    res, seq = run_seq(clean_kernel, "%%ddp --devices 2\nimport time\nprint('training', flush=True)\n"
                       "for i in tqdm(range(30), desc=f'rank {rank}'):\n    time.sleep(0.1)\n")
    assert res.error is None, res.error_text
    check_final_bars(res)
    _, states = dashboard_states(seq)
    live = [s["text/plain"] for s in states if "· running ·" in s["text/plain"]]
    assert live, "the dashboard was never updated while the ranks ran"
    assert any(re.search(r"^0\s+running\s+\d+%\s", t, re.MULTILINE)
               and re.search(r"^1\s+running\s+\d+%\s", t, re.MULTILINE)
               for t in live), live
    assert re.search(r"^1\s+finished\s+100%\s", states[-1]["text/plain"], re.MULTILINE), states[-1]["text/plain"]
    # the ranks' bars (one output) are redrawn in place while they run (3 s), at most every 0.2 s
    draws = [c["transient"]["display_id"] for kind, c in seq if kind == "update_display_data"
             and "-bar" in c["transient"]["display_id"]]
    assert all(5 <= draws.count(b) <= 20 for b in set(draws)) and len(set(draws)) == 1, draws


def test_pool_ranks_draw_text_bars_for_tqdm_imported_after_the_start(runs_dir):
    """A fresh kernel: the pool's ranks are forked before tqdm exists; the notebook imports it after, and
    the cell's bars (names sent to the ranks, imported there) still draw as text."""
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok("%load_ext nbddp")
        k.ok("%ddp start --devices 2")
        k.ok("from tqdm.notebook import tqdm as nb_bar, trange\nfrom tqdm.auto import tqdm as auto_bar")
        res = k.ok("%%ddp\nfor i in nb_bar(range(30), desc=f'nb {rank}'):\n    pass\n"
                   "for i in auto_bar(range(30), desc=f'auto {rank}'):\n    pass\n"
                   "for i in trange(30, desc=f'trange {rank}', display=False):\n    pass\n")
        check_final_bars(res, descs=("nb {r}", "auto {r}", "trange {r}"))
        k.ok("%ddp stop")


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
            m = re.match(r"\[rank([\d,-]+)\]:(.*)$", line)
            for r in ranks_of(m.group(1)) if m else ():
                order[r].append((name, m.group(2)))
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


@pytest.mark.unit
def test_the_order_budget_allows_a_burst_then_a_rate():
    from nbddp.wire.budget import Budget

    now = [100.0]  # the budget's clock, this test's (a loaded machine's own added tokens between two calls)
    b = Budget(burst=3, rate=1000.0, clock=lambda: now[0])
    assert [b.take() for _ in range(3)] == [True] * 3
    now[0] += 0.0005  # half a token's worth of time since the last refill
    assert not b.take()
    now[0] += 0.01  # ten tokens' worth: refilled up to the burst only
    assert [b.take() for _ in range(4)] == [True, True, True, False]


@pytest.mark.unit
def test_torchs_own_rank_prefix_is_not_doubled():
    """torch prefixes its C++ warnings with "[rankN]:" itself: the cell shows one, not "[rank1]:[rank1]:"."""
    from nbddp.kernel.ranks.supervisor import Output
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


# -- issue 20 point 3: a line every rank prints identically appears once -------------------------------
def test_identical_lines_appear_once_labelled_with_the_ranks_and_the_logs_keep_every_copy(clean_kernel, runs_dir):
    k = clean_kernel
    cell = ("%%ddp --devices 2{}\nimport torch.distributed as dist\ndist.barrier()\n"
            "print('Epoch 1 starting')\nprint(f'rank {{rank}} loss 0.{{rank}}')\nprint('Epoch 1 done')\n")
    res = k.ok(cell.format(""))
    lines = res.stdout.splitlines()
    assert lines.count("[rank0-1]:Epoch 1 starting") == 1 and lines.count("[rank0-1]:Epoch 1 done") == 1, lines
    assert "[rank0]:rank 0 loss 0.0" in lines and "[rank1]:rank 1 loss 0.1" in lines, lines
    assert len(lines) == 4
    run = max(runs_dir.iterdir(), key=lambda p: p.name)
    for r in (0, 1):
        assert (run / f"rank{r}.log").read_text().count("Epoch 1") == 2, "each rank's log keeps its own copy"
    only0 = k.ok(cell.format(" --ranks-output 0")).stdout.splitlines()
    assert only0 == ["[rank0]:Epoch 1 starting", "[rank0]:rank 0 loss 0.0", "[rank0]:Epoch 1 done"], only0
    bare = k.ok(cell.format(" --no-prefix")).stdout.splitlines()
    assert bare.count("Epoch 1 starting") == 2, "without labels, nothing is merged: the line would lose its ranks"


class Sink:
    def __init__(self):
        self.written = []

    def write(self, stream, text, rank=None):
        self.written.append((stream, text))

    def close(self):
        pass


def merging_relay(world_size=2):
    from nbddp.views.relay import Relay

    sink = Sink()
    return Relay(sink, ranks_output="all", prefix=True, max_lines=100, max_line_chars=1000, max_output_mb=1,
                 ranks=range(world_size)), sink


@pytest.mark.unit
def test_the_merger_keeps_each_ranks_order_and_waits_only_for_ranks_still_writing():
    from nbddp.kernel.ranks.supervisor import Output, OutputClosed
    from nbddp.units import rank_span
    from nbddp.views.relay import MERGE_S

    assert [rank_span(r) for r in ([0, 1], [0, 1, 2, 5], [3], [0, 2])] == ["0-1", "0-2,5", "3", "0,2"]
    relay, sink = merging_relay(3)
    relay.on_Output(Output(0, "stdout", b"Epoch 1\nloss 0\n"))
    relay.on_Output(Output(1, "stdout", b"Epoch 1\nloss 1\nEpoch 2\n"))
    assert sink.written == [], "rank 2 has written nothing yet: the lines wait for it"
    due = relay.release_due()
    assert due is not None and 0 < due - __import__("time").monotonic() <= MERGE_S
    relay.on_Output(Output(2, "stderr", b"Epoch 1\n"))  # the same text on another stream is another line
    relay.on_Output(Output(2, "stdout", b"Epoch 1\nloss 2\n"))
    relay.on_Output(Output(0, "stdout", b"Epoch 2\n"))
    relay.on_OutputClosed(OutputClosed(2, "stdout"))
    relay.on_OutputClosed(OutputClosed(2, "stderr"))  # rank 2 has left: not waited for
    relay.close_all()
    assert sink.written == [
        ("stdout", "[rank0-1]:Epoch 1\n"), ("stderr", "[rank2]:Epoch 1\n"),
        ("stdout", "[rank0]:loss 0\n"), ("stdout", "[rank1]:loss 1\n"), ("stdout", "[rank2]:Epoch 1\n"),
        ("stdout", "[rank0-1]:Epoch 2\n"), ("stdout", "[rank2]:loss 2\n"),
    ], sink.written


@pytest.mark.unit
def test_only_the_ranks_running_the_cell_are_merged_and_waited_for():
    """A pool cell on some ranks (--ranks 0,2): rank 1 is not waited for; its stray output goes straight out."""
    from nbddp.kernel.ranks.supervisor import Output
    from nbddp.views.relay import Relay

    sink = Sink()
    relay = Relay(sink, ranks_output="all", prefix=True, max_lines=100, max_line_chars=1000, max_output_mb=1,
                  ranks=(0, 2))
    relay.on_Output(Output(1, "stdout", b"from a thread on rank 1\n"))
    relay.on_Output(Output(0, "stdout", b"same\n"))
    relay.on_Output(Output(2, "stdout", b"same\n"))
    assert sink.written == [("stdout", "[rank1]:from a thread on rank 1\n"), ("stdout", "[rank0,2]:same\n")]


@pytest.mark.unit
def test_a_line_no_other_rank_prints_waits_at_most_the_window():
    import time

    from nbddp.kernel.ranks.supervisor import Output
    from nbddp.views.relay import MERGE_S

    relay, sink = merging_relay()
    relay.on_Output(Output(0, "stdout", b"only rank 0 says this\n"))
    time.sleep(MERGE_S + 0.05)
    assert relay.release_due() is None and sink.written == [("stdout", "[rank0]:only rank 0 says this\n")]


@pytest.mark.unit
def test_the_nbval_sanitizer_makes_a_runs_first_and_last_views_alike():
    """notebooks/nbval-sanitize.cfg: nbval compares a view's first state (it ignores display updates) with
    the saved last one; timings, memory and bars in whichever order the ranks start them differ per run."""
    import pathlib
    import re as regex

    from nbval.plugin import get_sanitize_patterns

    cfg = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "nbval-sanitize.cfg"
    patterns = get_sanitize_patterns(cfg.read_text())

    def clean(text):
        for pattern, replace in patterns:
            text = regex.sub(pattern, replace, text)
        return text

    first = ("nbddp · 2 ranks · cpu/gloo · starting · 0.0 s\nrank  state     time   last line\n0     starting  0.0 s\n"
             "logs: /root/.cache/nbddp/runs/20261122-185432.716641152-25640-74edef")
    last = ("nbddp · 2 ranks · cpu/gloo · finished · 1.9 s\nrank  state     time   private memory  last line\n"
            "0     finished  1.9 s  76 MB           epoch 2\nlogs: /tmp/x/20261122-190121.161910023-3769-73e176")
    assert clean(first) == clean(last) == "NBDDP-DASHBOARD"
    assert clean("nbddp pool · cell on ranks 0-1 · 1.7 ms · ok") == clean("nbddp pool · cell on ranks 0-1 · 2.3 s · ok")
    # a pool cell's line: nbval sees its first state (its place, reserved: "running") where the saved notebook
    # has its last
    assert clean("nbddp pool · cell on ranks 0-1 · running") == \
        clean("nbddp pool · cell on ranks 0-1 · 1.2 s · running · rank 0 40%, rank 1 38%") == \
        clean("nbddp pool · cell on ranks 0-1 · 2.3 s · failed: rank 1 ValueError") == \
        "nbddp pool · cell on ranks 0-1 · TIME · OUTCOME"
    bars = ["[rank1]:epoch 1:   0%|          | 0/20 [00:00<?, ?it/s]",
            "[rank0]:epoch 1: 100%|##########| 20/20 [00:01]"]
    assert clean(bars[0]) == clean(bars[1]) == "[rankN]:epoch 1: PROGRESS-BAR"
    assert clean("ready in 0.07 s, 12 MB, Cell In[12], pid 4242") == "ready in TIME s, N MB, Cell In[N], pid PID"
    assert clean("12.3 KiB") == clean("123 MiB") == clean("1.2 GiB") == "N MB", "every size units.size writes"
    assert clean("[rank0-1]:epoch 0 mean loss 0.4686") == "[rank0-1]:epoch 0 mean loss 0.4686", \
        "the user's own output stays"
