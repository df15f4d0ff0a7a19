"""``%%ddp --profile [STEPS]`` through a real kernel: a straggler named, the waiting measured, the traces written
(with HTA's distributedInfo), ``nbddp.profile()``'s DataFrame; nothing of it without the flag; bad values
refused. The summary's arithmetic on its own, without a kernel."""
import ast
import glob
import json
import os
import re

import pytest

from nbddp.kernel import profile
from nbddp.rank import profile_session

pytestmark = pytest.mark.timeout(240)

STEPS = 10
TRAIN = """\
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 256), torch.randn(32, 256)
for _ in range(13):
    if rank == 1:
        time.sleep(0.05)  # the straggler
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def profile_shown(res) -> str:
    texts = [d["data"]["text/plain"] for d in res.displays if "data" in d and
             d["data"].get("text/plain", "").startswith("nbddp profile")]
    assert len(texts) == 1, res
    assert any("<svg" in d["data"].get("text/html", "") for d in res.displays if "data" in d), "the bars"
    return texts[0]


def check_straggler(k, res):
    shown = profile_shown(res)
    assert re.search(rf"nbddp profile · 2 rank\(s\) · {STEPS} step\(s\)", shown), shown
    assert re.search(r"^rank 1 is the straggler: rank 0 spends \d+ % of its step waiting in all_reduce for rank 1, "
                     r"whose own step is", shown, re.M), shown
    traces = re.findall(r"^trace: (.+)$", shown, re.M)
    assert [os.path.basename(t) for t in traces] == ["rank0.trace.json", "rank1.trace.json"], shown
    for rank, path in enumerate(traces):
        assert os.path.exists(os.path.join(os.path.dirname(path), f"rank{rank}.log")), "beside the rank's log"
        with open(path) as f:
            info = json.load(f)["distributedInfo"]
        assert (info["backend"], info["rank"], info["world_size"]) == ("gloo", rank, 2), info
    rows = json.loads(ast.literal_eval(k.ok("import nbddp\nnbddp.profile().to_json(orient='records')").result))
    assert [r["rank"] for r in rows] == [0, 1] and all(r["steps"] == STEPS for r in rows), rows
    assert list(rows[0]) == list(profile.COLUMNS)
    r0, r1 = rows
    assert r0["wait_s"] - r1["wait_s"] >= 0.3, rows  # rank 0 waits ~50 ms a step for rank 1
    for r in rows:
        parts = r["compute_s"] + r["comm_s"] + r["data_s"] + r["other_s"]
        assert abs(parts - r["step_s"]) < 0.01 * r["step_s"] + 1e-3 and r["wait_s"] <= r["comm_s"], r
    assert r1["other_s"] >= 0.4, rows  # its sleeps: no op, no collective
    return rows


def test_one_shot_cell_names_the_straggler_and_writes_the_traces(clean_kernel):
    k = clean_kernel
    res = k.ok(f"%%ddp --devices 2 --profile {STEPS}\n" + TRAIN)
    check_straggler(k, res)


def test_pool_cell_profiles_too_and_a_cell_without_the_flag_profiles_nothing(pool, runs_dir):
    k = pool
    check_straggler(k, k.ok(f"%%ddp --profile {STEPS}\n" + TRAIN))
    before = set(glob.glob(f"{runs_dir}/**/*.trace.json", recursive=True))
    res = k.ok("%%ddp --gather hooks on\n" + TRAIN + "from torch.optim import optimizer\nimport "
               "torch.autograd.profiler as ap\n"
               "from nbddp.rank import profile_session\nhooks = len(optimizer._global_optimizer_post_hooks)\n"
               "on = ap._is_profiler_enabled or profile_session._session is not None\n")
    assert k.value("hooks") == [0, 0] and k.value("on") == [False, False], "no hook, no profiler without --profile"
    assert not [d for d in res.displays if d.get("data", {}).get("text/plain", "").startswith("nbddp profile")]
    assert set(glob.glob(f"{runs_dir}/**/*.trace.json", recursive=True)) == before, "no trace written"


def test_steps_without_an_optimizer_and_no_steps_at_all(clean_kernel):
    k = clean_kernel
    shown = profile_shown(k.ok("%%ddp --devices 2 --profile 2\nimport time\nfrom nbddp.rank import profile_session\n"
                               "for _ in range(5):\n    time.sleep(0.01)\n    profile_session.step()\n"))
    assert re.search(r"nbddp profile · 2 rank\(s\) · 2 step\(s\)", shown), shown
    assert re.search(r"^rank \d's step is|^no straggler|is the straggler", shown, re.M), shown
    short = profile_shown(k.ok("%%ddp --devices 2 --profile 10\nfrom nbddp.rank import profile_session\n"
                               "for _ in range(4):\n    profile_session.step()\n"))
    assert "nbddp profile · 2 rank(s) · 3 step(s) (of 10 asked: the cell ended first)" in short, short
    none = k.ok("%%ddp --devices 2 --profile\nx = 1\n")
    assert "nbddp: --profile: no optimizer step or logged step happened: nothing was profiled\n" in none.stderr, none
    assert not none.displays or "nbddp profile" not in str(none.displays), none


@pytest.mark.parametrize("value, said", [
    ("0", "--profile 0: need a whole number of steps >= 1."),
    ("x", "argument --profile: invalid number of steps (such as 10) value: 'x'"),
])
def test_a_bad_value_is_refused_and_nothing_runs(clean_kernel, value, said):
    k = clean_kernel
    res = k.run(f"%%ddp --devices 2 --profile {value}\nprint('ran')\n", timeout=30)
    assert said in res.error_text and "Nothing ran" in res.error_text, res
    assert "ran" not in res.stdout


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_launch_refuses_profile():
    import nbddp

    with pytest.raises(nbddp.UsageError, match="--profile is for %%ddp cells"):
        nbddp.launch(print, devices=2, profile=3)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_waiting_is_the_time_past_the_latest_arrival():
    """Two collectives: rank 0 enters the first 0.2 s before rank 1, rank 1 the second 0.1 s before rank 0."""
    summary = {"steps": 2, "step_s": 1.0, "compute_s": 0.3, "comm_s": 0.4, "data_s": 0.1, "other_s": 0.2}
    r0 = {**summary, "rank": 0, "trace": "a", "collectives": [("all_reduce", 10.0, 0.25), ("broadcast", 11.0, 0.05)]}
    r1 = {**summary, "rank": 1, "trace": "b", "collectives": [("all_reduce", 10.2, 0.05), ("broadcast", 10.9, 0.3)]}
    p = profile.combine([r1, r0])
    assert [row["rank"] for row in p.rows] == [0, 1]
    assert p.rows[0]["wait_s"] == pytest.approx(0.2) and p.rows[1]["wait_s"] == pytest.approx(0.1)
    assert p.verdict.startswith("rank 1 is the straggler: rank 0 spends 20 % of its step waiting in all_reduce for "
                                "rank 1")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_summary_splits_the_window_by_the_rules():
    """comm first, then data loading, then the step thread's ops; other is the rest of the window."""
    X = "X"
    ev = [{"ph": X, "name": profile_session.MARK_START, "ts": 0, "dur": 1, "tid": 7, "cat": "user_annotation"},
          {"ph": X, "name": "aten::mm", "ts": 10, "dur": 40, "tid": 7, "cat": "cpu_op"},
          {"ph": X, "name": "gloo:all_reduce", "ts": 40, "dur": 30, "tid": 9, "cat": "user_annotation"},
          {"ph": X, "name": "enumerate(DataLoader)#_X.__next__", "ts": 80, "dur": 10, "tid": 7,
           "cat": "user_annotation"},
          {"ph": X, "name": "aten::add", "ts": 85, "dur": 2, "tid": 8, "cat": "cpu_op"},  # another thread: not compute
          {"ph": X, "name": profile_session.MARK_STOP, "ts": 99, "dur": 1, "tid": 7, "cat": "user_annotation"}]
    s = profile_session.summarise({"traceEvents": ev}, t0=100.0)
    assert s["step_s"] == pytest.approx(100e-6)
    assert (s["comm_s"], s["data_s"], s["compute_s"]) == pytest.approx((30e-6, 10e-6, 30e-6))
    assert s["other_s"] == pytest.approx(30e-6)
    assert s["collectives"] == [("all_reduce", pytest.approx(100.0 + 40e-6), pytest.approx(30e-6))]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_on_a_gpu_nccls_kernels_are_communication_todays_names_included():
    """A GPU trace (no GPU here: its events as kineto writes them): NCCL's kernels, ``ncclKernel_*`` and today's
    ``ncclDevKernel_*`` (which Holistic Trace Analysis takes for compute), are communication; the other kernels
    are compute; the CPU's own ops are not counted twice."""
    X = "X"
    ev = [{"ph": X, "name": profile_session.MARK_START, "ts": 0, "dur": 1, "tid": 7, "cat": "user_annotation"},
          {"ph": X, "name": "aten::mm", "ts": 2, "dur": 5, "tid": 7, "cat": "cpu_op"},
          {"ph": X, "name": "ampere_sgemm_128x64_tn", "ts": 10, "dur": 30, "tid": 20, "cat": "kernel"},
          {"ph": X, "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "ts": 40,
           "dur": 25, "tid": 21, "cat": "kernel"},
          {"ph": X, "name": "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
           "ts": 70, "dur": 10, "tid": 21, "cat": "kernel"},
          {"ph": X, "name": profile_session.MARK_STOP, "ts": 99, "dur": 1, "tid": 7, "cat": "user_annotation"}]
    s = profile_session.summarise({"traceEvents": ev}, t0=0.0)
    assert (s["comm_s"], s["compute_s"]) == pytest.approx((35e-6, 30e-6))
    assert [name for name, _, _ in s["collectives"]] == ["AllReduce", "AllGather"]


@pytest.mark.unit
def test_waits_of_collectives_that_overlap_count_once_and_unmatched_ranks_are_said():
    """gloo runs DDP's buckets two at a time: a rank waiting in both at once waited once."""
    summary = {"steps": 1, "step_s": 1.0, "compute_s": 0.1, "comm_s": 0.6, "data_s": 0.0, "other_s": 0.3}
    r0 = {**summary, "rank": 0, "trace": "a", "collectives": [("all_reduce", 10.0, 0.5), ("all_reduce", 10.0, 0.5)]}
    r1 = {**summary, "rank": 1, "trace": "b", "collectives": [("all_reduce", 10.4, 0.1), ("all_reduce", 10.4, 0.1)]}
    assert profile.combine([r0, r1]).rows[0]["wait_s"] == pytest.approx(0.4)
    r1_short = {**r1, "collectives": r1["collectives"][:1]}
    p = profile.combine([r0, r1_short])
    assert all(row["wait_s"] == 0 for row in p.rows) and any("different numbers of collectives" in x
                                                             for x in p.problems)
