"""Every rank's output reaches the cell whole, in order, marked; progress bars redraw; logs keep all."""
import re
from collections import defaultdict

import pytest

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


def test_a_line_without_end_is_shown_in_bounded_pieces(clean_kernel):
    res = clean_kernel.ok("%%ddp --devices 2 --ranks-output 0\nimport sys\nsys.stdout.write('x' * 3_000_000)\n")
    pieces = by_rank(res.stdout)[0]
    assert "".join(pieces) == "x" * 3_000_000
    assert len(pieces) >= 2


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
