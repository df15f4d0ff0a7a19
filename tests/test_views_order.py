"""What the views show, in which order (issue 35): bars in rank order across epochs, drawn at the rank's last
state however the cell ends (an interrupt's stack dump included), the pool cell's own live line, a pool view
of fixed width whatever its age."""
import re
import time

import pytest

from kernel import Kernel

pytestmark = pytest.mark.timeout(240)


class BarSink:
    """A relay's sink in a kernel, recorded: each bar output's states by id, in the order they were made."""

    def __init__(self):
        self.states: dict[str, list[dict]] = {}
        self.written = []

    def write(self, stream, text, rank=None):
        self.written.append(text)

    def live(self):
        return True

    def bar(self, number, bar_id, data):
        bar_id = bar_id or f"bars{number}"
        self.states.setdefault(bar_id, []).append(data)
        return bar_id

    def close(self):
        pass


def tqdm_text(desc: str, n: int, total: int) -> str:
    pct = n * 100 // total
    return f"{desc}: {pct:3d}%|{'#' * (pct // 10):10s}| {n}/{total} [00:01<00:01, 20.00it/s]"


def bar_record(desc: str, n: int, total: int, bar: int = 0, closed: bool = False, leave: bool = True):
    """A rank's tqdm bar as it sends it (messages.Progress): tqdm's state and its text line."""
    from nbddp.wire.messages import Progress

    state = {"n": n, "total": total, "elapsed": 1.0, "prefix": desc, "unit": "it", "rate": 20.0}
    return Progress(bar, state, tqdm_text(desc, n, total), closed, leave)


def draw(relay, rank: int, desc: str, n: int, total: int, bar: int = 0, **how) -> None:
    """The rank's bar ``bar`` redrawn (``closed``: its last state; ``leave=False`` too: cleared)."""
    from nbddp.kernel.ranks.supervisor import Message

    relay.on_Message(Message(rank, bar_record(desc, n, total, bar, **how)))


def relay_of(ranks, sink):
    from nbddp.views.relay import Relay

    return Relay(sink, ranks_output="all", prefix=True, max_lines=10**6, max_line_chars=10**4, max_output_mb=100,
                 ranks=ranks)


@pytest.mark.unit
def test_bars_are_in_rank_order_in_one_output_per_epoch_whichever_rank_draws_first():
    from nbddp.views.relay import BAR_GATHER_S

    sink = BarSink()
    relay = relay_of(range(4), sink)
    for epoch, arrival in enumerate(([1, 0, 2, 3], [3, 2, 0, 1], [2, 0, 3, 1])):
        for r in arrival:  # each epoch's bars start in another order
            draw(relay, r, f"epoch {epoch}", 0, 20, bar=epoch)
        for r in arrival:
            draw(relay, r, f"epoch {epoch}", 20, 20, bar=epoch, closed=True)
    assert list(sink.states) == ["bars0", "bars1", "bars2"], "one output per epoch"
    for states in sink.states.values():
        first, last = states[0]["text/plain"].splitlines(), states[-1]["text/plain"].splitlines()
        assert [ln[:7] for ln in last] == ["[rank0]", "[rank1]", "[rank2]", "[rank3]"], last
        assert all("20/20" in ln for ln in last)
        assert len(first) == 4, f"shown once every rank's bar is in (within {BAR_GATHER_S} s): {first}"
        assert states[-1]["text/html"].count("class='nbddp-bar'") == 4


@pytest.mark.unit
def test_a_group_waits_for_a_rank_drawing_no_bar_at_most_the_gather_window():
    from nbddp.views.relay import BAR_GATHER_S

    sink = BarSink()
    relay = relay_of(range(2), sink)  # only rank 0 draws a bar (tqdm(disable=rank != 0))
    draw(relay, 0, "train", 3, 20)
    assert not sink.states
    due = relay.release_due()
    assert due is not None and due - time.monotonic() <= BAR_GATHER_S
    deadline = time.monotonic() + 5
    while not sink.states and time.monotonic() < deadline:
        time.sleep(max(0.0, (relay.release_due() or time.monotonic()) - time.monotonic()))
    assert sink.states["bars0"][0]["text/plain"].startswith("[rank0]:train:  15%")


@pytest.mark.unit
def test_a_bar_ends_at_the_state_held_back_with_a_stack_dump():
    """An interrupt's stacks: the rank's stderr is kept from the cell for up to 2 s while its bar goes on;
    the bar must end where the rank's did, not where the cell last saw it."""
    from nbddp.kernel.ranks.stacks import StackCapture
    from nbddp.kernel.ranks.supervisor import Output, StacksRequested

    sink = BarSink()
    relay = relay_of([0], sink)
    capture = StackCapture(relay)  # in front of the relay, as in a cell
    draw(capture, 0, "train", 96, 1000)
    capture.on_StacksRequested(StacksRequested([0]))
    kept = 'Current thread 0x00007f0000000000 (most recent call first):\n  File "<cell>", line 3 in <module>\n'
    capture.on_Output(Output(0, "stderr", kept.encode()))  # the stack dump, held back from the cell
    draw(capture, 0, "train", 120, 1000)  # the bar's records meanwhile, on the channel
    draw(capture, 0, "train", 136, 1000)
    relay.close_all()
    assert "Current thread" not in "".join(sink.written)  # the dump is kept for the report, not shown
    last = list(sink.states.values())[-1][-1]
    from nbddp.views.theme import WARN

    assert "136/1000" in last["text/plain"] and WARN in last["text/html"], last  # final, not finished


@pytest.mark.unit
def test_text_and_bars_start_in_the_same_column_in_the_html():
    """JupyterLab pads a text output 1ch and an HTML one not at all: the bars' block makes up the difference
    in the stream's own font, and labels a rank as its lines do ("[rank0]:")."""

    sink = BarSink()
    relay = relay_of([0], sink)
    draw(relay, 0, "e", 20, 20, closed=True)
    html = list(sink.states.values())[-1][-1]["text/html"]
    assert "margin-left:1ch" in html and "var(--jp-code-font-family" in html and "var(--jp-code-font-size" in html
    assert re.search(r">\[rank0\]:e: <span", html), html


# -- through a real kernel ---------------------------------------------------------------------------------
LONG_BARS = ("%%ddp --devices 2{opts}\nimport time\nfrom tqdm.auto import tqdm\n"
             "for i in tqdm(range(1000), desc=f'rank {{rank}}', mininterval=0.05):\n"
             "    if i == 30:\n        print('far', flush=True)\n    time.sleep(0.02)\n")


def bar_rows(res) -> dict[int, str]:
    """The saved (last) state of the cell's bar output: each rank's text bar."""
    last = list(res.bar_states.values())[-1] if res.bar_states else {}
    rows = {}
    for line in last.get("text/plain", "").splitlines():
        m = re.match(r"\[rank(\d+)\]:(.*)$", line)
        rows[int(m.group(1))] = m.group(2)
    return rows


def logged_bar(runs_dir, rank: int) -> str:
    """The rank's last tqdm state, from its log (every byte it wrote, its bars as tqdm's text) in the newest
    run directory."""
    run = max((p for p in runs_dir.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    text = (run / f"rank{rank}.log").read_text(errors="replace")
    return [seg for seg in re.split(r"[\r\n]", text) if re.search(r"\d+%\|", seg)][-1]


@pytest.mark.parametrize("how", ["interrupt", "timeout"])
def test_a_bar_is_saved_at_the_ranks_last_state_however_the_cell_ends(clean_kernel, runs_dir, how):
    k = clean_kernel
    if how == "interrupt":
        res = k.interrupt_when(LONG_BARS.format(opts=""), "far", 2, timeout=60)
        assert res.error and res.error["ename"] == "KeyboardInterrupt", res
    else:
        res = k.run(LONG_BARS.format(opts=" --timeout 3"), timeout=60)
        assert res.error and "--timeout 3s expired" in res.error_text, res.error_text
    rows = bar_rows(res)
    assert sorted(rows) == [0, 1], rows
    for r in (0, 1):
        assert rows[r] == logged_bar(runs_dir, r), \
            f"rank {r}: saved {rows[r]!r}, the rank drew last {logged_bar(runs_dir, r)!r}"
        assert not rows[r].startswith(f"rank {r}: 100%"), rows[r]


def test_bars_stay_in_rank_order_across_epochs_in_a_real_cell(clean_kernel):
    """Four ranks, each epoch's bars started in another order (rank-dependent sleeps): every epoch's output
    lists rank 0 to 3, in order, at 100 %."""
    res = clean_kernel.ok(
        "%%ddp --devices 4\nimport time\nfrom tqdm.auto import tqdm\nfor epoch in range(3):\n"
        "    time.sleep(0.05 * ((rank + epoch * 3) % 4))\n"
        "    for i in tqdm(range(10), desc=f'epoch {epoch}'):\n        time.sleep(0.01)\n", timeout=90)
    outputs = {did: data["text/plain"] for did, data in res.bar_states.items()}
    assert len(outputs) == 3, outputs
    for epoch, text in enumerate(outputs.values()):
        rows = text.splitlines()
        assert [r[:8] for r in rows] == [f"[rank{r}]:" for r in range(4)], rows
        assert all(row.startswith(f"[rank{r}]:epoch {epoch}: 100%") for r, row in enumerate(rows)), rows


def line_messages(seq) -> list:
    """(kind, content) of the pool cell's own line (its display id), in order."""
    return [(kind, c) for kind, c in seq if kind in ("display_data", "update_display_data")
            and c.get("transient", {}).get("display_id", "").startswith("nbddp-line-")]


def outputs(seq) -> list[str]:
    """The cell's outputs as they land, in order: "line" (the line's own output, made), "text" (a stream),
    "display" (another output made: a bar, a rank's display), "error", "out" (Out[]). Updates (the line's, the
    pool view's in the %ddp start cell) make no output."""
    shown = []
    for kind, c in seq:
        did = c.get("transient", {}).get("display_id", "") if isinstance(c, dict) else ""
        if kind == "display_data":
            shown.append("line" if did.startswith("nbddp-line-") else "display")
        elif kind in ("stream", "error"):
            shown.append("text" if kind == "stream" else "error")
        elif kind == "execute_result":
            shown.append("out")
    return shown


def run_seq(k, code, timeout=60):
    seq = []
    res = k.collect(k.execute(code), timeout=timeout, on_message=lambda kind, c: seq.append((kind, c)))
    return res, seq


def test_a_pool_cell_shows_its_own_live_line_that_ends_as_its_final_line(runs_dir):
    """A pool cell past its first second: its own line, live each tick (running, each rank's progress), then
    the final line in the same output; a quick cell: its place, then its final line there."""
    k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)})
    try:
        k.ok("%load_ext nbddp")
        k.ok("%ddp start --devices 2")
        res, seq = run_seq(k, "%%ddp\nimport time\nfrom tqdm.auto import tqdm\n"
                              "for i in tqdm(range(30), desc='train'):\n    time.sleep(0.1)\n")
        assert res.error is None, res.error_text
        lines = line_messages(seq)
        assert lines and lines[0][0] == "display_data" and all(kind == "update_display_data" for kind, _ in lines[1:])
        texts = [c["data"]["text/plain"] for _, c in lines]
        assert texts[0] == "nbddp pool · cell on ranks 0-1 · running", texts  # its place, as the cell began
        assert re.fullmatch(r"nbddp pool · cell on ranks 0-1 · 1\.\d s · running( · .*)?", texts[1]), texts
        assert any(re.search(r"· running · rank 0 \d+%, rank 1 \d+%$", t) for t in texts), texts
        assert re.fullmatch(r"nbddp pool · cell on ranks 0-1 · \d\.\d s · ok", texts[-1]), texts
        quick, seq = run_seq(k, "%%ddp\nrank")
        assert [c["data"]["text/plain"].rsplit(" · ", 1)[-1] for _, c in line_messages(seq)] == ["running", "ok"], seq
        k.ok("%ddp stop")
    finally:
        k.shutdown()


def test_a_pool_cells_line_is_the_first_of_its_outputs_never_between_its_lines(runs_dir):
    """Issue 42: the live line was published at the first tick, after the text so far, and the text after it
    ran below it (stream, stream, display, stream): in the browser it sat in the middle of the output. Its
    place is now reserved before any of the cell's output, whatever the cell does: text before and after
    its first second, a quick cell, a failure, a tqdm bar (a display of its own), and a notebook cell that
    printed before it ran a pool cell (that text was the notebook cell's first)."""
    k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)})
    try:
        k.ok("%load_ext nbddp")
        k.ok("%ddp start --devices 2")
        cells = {
            "long": ("%%ddp\nimport time\nprint('before its first second', flush=True)\nfor i in range(4):\n"
                     "    time.sleep(0.4)\n    print(f'step {i}', flush=True)\n", "ok"),
            "quick": ("%%ddp\nprint('hello')\nrank\n", "ok"),
            "failed": ("%%ddp\nimport time\nprint('start', flush=True)\ntime.sleep(1.3)\nprint('more', flush=True)\n"
                       "raise ValueError('boom')\n", "failed: rank 0 ValueError, rank 1 ValueError"),
            "bars": ("%%ddp\nimport time\nfrom tqdm.auto import tqdm\nprint('epoch 1', flush=True)\n"
                     "for i in tqdm(range(15)):\n    time.sleep(0.1)\nprint('done', flush=True)\n", "ok"),
        }
        for name, (code, outcome) in cells.items():
            for _ in range(2):  # the second: the IO thread's queue already ticking from the first line
                res, seq = run_seq(k, code)
                shown = outputs(seq)
                assert shown[0] == "line" and shown.count("line") == 1, (name, shown)
                assert "text" in shown, (name, shown)
                lines = line_messages(seq)
                assert all(kind == "update_display_data" for kind, _ in lines[1:]), (name, lines)
                assert lines[-1][1]["data"]["text/plain"].endswith(f"· {outcome}"), (name, lines[-1])
        # text the notebook cell wrote before it ran a pool cell stays above that cell's line
        res, seq = run_seq(k, "print('the notebook first')\nget_ipython().run_cell_magic('ddp', '', 'print(rank)')\n")
        shown = outputs(seq)
        first_text = next(c["text"] for kind, c in seq if kind == "stream")
        assert shown[:3] == ["text", "line", "text"] and first_text.startswith("the notebook first"), (shown, seq)
        k.ok("%ddp stop")
    finally:
        k.shutdown()


def test_sampling_walks_a_ranks_pages_only_when_its_faults_say_its_memory_moved(monkeypatch):
    """USS (a page-table walk, ~5 ms a rank) is the dashboard's one costly read: each rank's first in turn,
    then at most every USS_EVERY samples and only after new page faults; RSS every sample (/proc, cheap)."""
    import os

    from nbddp.hw import procmem
    from nbddp.views import monitor

    if not procmem.PROC:
        pytest.skip("no /proc/PID/smaps_rollup here: psutil reads it")
    go, wait = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(ready_w, b"r")  # (a fresh fork's first moments fault in many pages: it waits after them)
        os.read(go, 1)
        grown = bytearray(50 * 2**20)  # noqa: F841 - held, not read: 50 MiB of its own
        os.write(ready_w, b"g")  # (grown whole: a loaded machine once had a sample fall mid-growth, two walks)
        time.sleep(30)
        os._exit(0)
    walks = []
    real = procmem.uss_of
    monkeypatch.setattr(procmem, "uss_of", lambda p: walks.append(p) or real(p))
    m = monitor.Monitor([])
    m.watch(0, pid)
    m.watch(1, os.getpid())  # rank 1: its first walk waits a sample
    assert os.read(ready_r, 1) == b"r"
    try:
        m.sample()
        assert walks == [pid] and m.ranks[0].rss > 0
        m.sample()
        assert walks == [pid, os.getpid()]
        for _ in range(monitor.USS_EVERY * 2):  # idle: no walk
            m.sample()
        assert walks.count(pid) == 1
        before = m.ranks[0].uss
        os.write(wait, b"x")
        assert os.read(ready_r, 1) == b"g"
        deadline = time.monotonic() + 10
        while m.ranks[0].uss < before + 40 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.05)
            m.sample()
        assert m.ranks[0].uss >= before + 40 * 2**20, m.ranks[0]
        assert walks.count(pid) == 2, "one more walk once its faults grew"
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    m.sample()
    assert 0 in m.lost and m.ranks[0].peak_uss >= 40 * 2**20


@pytest.mark.unit
def test_the_many_cpu_ranks_note_wraps_between_words():
    """The note was one 230-character line that a notebook breaks mid-word: lines of at most 88, whole words."""
    from nbddp.kernel import checks, devices

    checks._warned_oversubscribed.discard((64, 1))
    note = checks._oversubscribed(devices.Plan("cpu", "gloo", (None,) * 64), 1)
    if not note:
        pytest.skip("this machine has 64 cores or more")
    lines = note[0].splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= checks.NOTE_WIDTH, lines
    assert lines[0].startswith("nbddp: 64 CPU ranks on ") and " ".join(lines).endswith("still stop every rank.")


# -- the bars' cost: what is published, what is kept ------------------------------------------------------
@pytest.mark.unit
def test_64_ranks_ending_a_bar_publish_a_few_outputs_not_one_a_rank():
    """Each publish carries every row: one a rank's final state was O(ranks²) bytes an epoch at 64 ranks."""

    sink = BarSink()
    relay = relay_of(range(64), sink)
    for r in range(64):
        draw(relay, r, "epoch 0", 0, 20)
    for r in range(64):
        draw(relay, r, "epoch 0", 20, 20, closed=True)
        relay.release_due()
    assert list(sink.states) == ["bars0"] and len(sink.states["bars0"]) <= 3, len(sink.states["bars0"])
    last = sink.states["bars0"][-1]["text/plain"].splitlines()
    assert len(last) == 64 and all("20/20" in ln for ln in last), "the last state shown at once"
    # and at an interrupt: every bar still drawing kept, one publish for the group
    sink = BarSink()
    relay = relay_of(range(64), sink)
    for r in range(64):
        draw(relay, r, "epoch 0", 3, 20)
    relay.close_all()
    assert len(sink.states["bars0"]) == 2, len(sink.states["bars0"])
    from nbddp.views.theme import RUNNING, WARN

    assert WARN in sink.states["bars0"][-1]["text/html"] and RUNNING not in sink.states["bars0"][-1]["text/html"]


@pytest.mark.unit
def test_a_rows_final_state_waits_for_the_next_redraw_and_the_close_shows_it():
    from nbddp.views.relay import BAR_EVERY_S

    sink = BarSink()
    relay = relay_of(range(2), sink)
    for r in (0, 1):
        draw(relay, r, "e", 1, 20)
    draw(relay, 0, "e", 20, 20, closed=True)
    assert len(sink.states["bars0"]) == 1, "rank 1's bar still draws: rank 0's end waits for the redraw"
    due = relay.release_due()
    assert due is not None and due - time.monotonic() <= BAR_EVERY_S
    time.sleep(max(0.0, due - time.monotonic()))
    relay.release_due()
    assert len(sink.states["bars0"]) == 2 and "20/20" in sink.states["bars0"][-1]["text/plain"].splitlines()[0]
    assert relay.release_due() is None
    draw(relay, 1, "e", 7, 20)
    relay.close_all()
    assert "7/20" in sink.states["bars0"][-1]["text/plain"].splitlines()[1]


@pytest.mark.unit
def test_thousands_of_short_bars_keep_few_groups_and_a_cheap_due():
    """tqdm(leave=False) a step: a group a step; finished groups go, and due() looks only at dirty ones."""
    from nbddp.views.relay import BAR_KEEP

    for ranks, drawing in ((range(4), range(4)), (range(2), [0])):  # every rank's bars; rank 0's only
        sink = BarSink()
        relay = relay_of(ranks, sink)
        for step in range(3000):
            for r in drawing:
                draw(relay, r, "step", 20, 20, bar=step, closed=True)
            relay.release_due()
        bars = relay.bars
        assert len(bars.groups) <= BAR_KEEP + 1 and len(bars.settled) <= BAR_KEEP and not bars.dirty, len(bars.groups)
        t0 = time.perf_counter()
        for _ in range(1000):
            bars.due()
        assert time.perf_counter() - t0 < 0.05
        relay.close_all()


@pytest.mark.unit
def test_a_bar_cleared_before_it_was_shown_publishes_nothing():
    """A quick tqdm(leave=False) bar: no empty output for it in the saved notebook."""
    from nbddp.views.relay import BAR_GATHER_S

    sink = BarSink()
    relay = relay_of(range(2), sink)
    for r in (0, 1):
        draw(relay, r, "step", 3, 20)
        draw(relay, r, "step", 3, 20, closed=True, leave=False)  # cleared (rank 0: before shown)
    time.sleep(BAR_GATHER_S + 0.05)
    relay.release_due()
    draw(relay, 0, "step", 3, 20, bar=1)
    draw(relay, 0, "step", 3, 20, bar=1, closed=True, leave=False)  # gathering (rank 1's not in)
    time.sleep(BAR_GATHER_S + 0.05)
    relay.release_due()
    relay.close_all()
    firsts = [states[0] for states in sink.states.values()]
    assert all(s is not None and s.get("text/plain") for s in firsts), sink.states
    # a bar shown, then cleared: its output is blanked in place (an update, not a new output)
    sink = BarSink()
    relay = relay_of([0], sink)
    draw(relay, 0, "step", 3, 20)
    draw(relay, 0, "step", 3, 20, closed=True, leave=False)
    relay.close_all()
    assert [s["text/plain"][:14] for s in sink.states["bars0"]] == ["[rank0]:step: ", ""], sink.states


# -- sampling: what a rank's private memory costs, and a figure for every rank -------------------------------
def fake_proc(monkeypatch, proc: bool) -> list:
    """procmem as a machine with (or without) smaps_rollup, its ranks' pids made up: the USS walks made."""
    from nbddp.hw import procmem

    walks = []
    monkeypatch.setattr(procmem, "PROC", proc)
    monkeypatch.setattr(procmem, "rss_of", lambda pid: 100 * 2**20)
    monkeypatch.setattr(procmem, "faults_of", lambda pid: 10**6 + len(walks) * 10**4)  # always moving
    monkeypatch.setattr(procmem, "uss_of", lambda pid: walks.append(pid) or 60 * 2**20)
    return walks


@pytest.mark.unit
@pytest.mark.parametrize("proc", [True, False])
def test_without_smaps_rollup_a_rank_is_walked_at_most_every_uss_every_samples(monkeypatch, proc):
    """psutil's memory_full_info walks the pages too: it was read for every rank at every sample."""
    from nbddp.views import monitor

    walks = fake_proc(monkeypatch, proc)
    m = monitor.Monitor([])
    for rank in range(8):
        m.watch(rank, 1000 + rank)
    n = monitor.USS_EVERY * 4
    for _ in range(n):
        m.sample()
    for rank in range(8):
        assert 1 <= walks.count(1000 + rank) <= n // monitor.USS_EVERY, (rank, walks.count(1000 + rank))
    del walks[:]
    m.sample(force=True)
    assert sorted(walks) == [1000 + r for r in range(8)]


class _Plan:
    def __init__(self, n):
        self.world_size, self.device_ids, self.accelerator, self.backend = n, (None,) * n, "cpu", "gloo"


class _RunDir:
    path = "/tmp/nbddp-test-run"


@pytest.mark.unit
def test_a_short_cells_final_table_has_every_ranks_private_memory(monkeypatch):
    """The samples read the ranks' USS in turn (rank r's first at sample r % USS_EVERY): a cell done after a
    tick or two had it blank for most ranks. A rank done, or leaving, reads those never read; a quick cell
    (never sampled) pays no walk."""
    from types import SimpleNamespace

    from nbddp.kernel.ranks.supervisor import Exited, Message, Started
    from nbddp.views import monitor
    from nbddp.views.dashboard import RunView
    from nbddp.wire.messages import Result

    walks = fake_proc(monkeypatch, True)
    exit_ok = SimpleNamespace(ok=True, code=0, stopped=False, max_rss=0)
    for sampled in (True, False):
        del walks[:]
        view = RunView(live=False)
        view.begin(_Plan(8), _RunDir())
        for rank in range(8):
            view.on_Started(Started(rank, 1000 + rank))
        if sampled:
            view.tick()
            assert sorted(walks) == [1000 + r for r in range(8) if r % monitor.USS_EVERY == 0]
        view.on_Message(Message(3, Result(value=None)))
        view.on_Exited(Exited(3, exit_ok))
        for rank in range(8):
            if rank != 3:
                view.on_Message(Message(rank, Result(value=None)))
                view.on_Exited(Exited(rank, exit_ok))
        view.finish(None)
        cols, rows = view.rows()
        if sampled:
            assert sorted(walks) == [1000 + r for r in range(8)], "each rank read once"
            assert all(row.get("private memory") == "60.0 MiB" for row in rows), rows
        else:
            assert not walks and "private memory" not in cols


@pytest.mark.unit
def test_a_one_rank_pool_says_rank_not_ranks():
    from nbddp.views.poolview import PoolView

    assert " · 1 rank · cpu/gloo · " in PoolView(_Plan(1), _RunDir(), shown=False).title()
    assert " · 2 ranks · cpu/gloo · " in PoolView(_Plan(2), _RunDir(), shown=False).title()
