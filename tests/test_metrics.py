"""nbddp.log: charts of what ranks log, nbddp.metrics(), metrics.csv, tqdm postfixes, the slow rank named.
Through real kernels with real forked gloo ranks; the chart drawing and the rank's batching directly."""
from __future__ import annotations

import math
import re
import time

import pytest

from kernel import Kernel
from nbddp.rank import metrics_log
from nbddp.views import metrics_chart
from nbddp.wire import messages

pytestmark = pytest.mark.timeout(300)

LOG_CELL = """%%ddp --devices 2
import math, time
import nbddp
for step in range(200):
    nbddp.log(loss=math.exp(-step / 50) + rank / 100, lr=0.1)
    if step % 40 == 0:
        time.sleep(0.4)  # the cell lasts past two ticks: the chart is drawn while it runs
print('done', rank)
"""


def chart_displays(res) -> list[dict]:
    return [d["data"] for d in res.displays if "nbddp-charts" in d.get("data", {}).get("text/html", "")]


def last_steps(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\(step (\d+)\)", text)]


@pytest.fixture(scope="module")
def kernel():
    with Kernel() as k:
        k.ok("%load_ext nbddp")
        yield k


def test_a_two_rank_cell_logging_200_steps_is_charted_live_then_kept_and_its_metrics_are_exact(kernel):
    res = kernel.run(LOG_CELL, timeout=120)
    assert res.error is None, res
    drawn = chart_displays(res)
    assert len(drawn) >= 2, f"one drawing while it ran, one at the end: {len(drawn)}"
    assert min(last_steps(drawn[0]["text/plain"])) < 199, drawn[0]["text/plain"]  # live: before the last step
    final = drawn[-1]
    assert last_steps(final["text/plain"]) == [199, 199, 199, 199], final["text/plain"]
    html = final["text/html"]
    assert html.count("<svg") == 2 and ">loss</text>" in html and ">lr</text>" in html  # a panel per name
    assert ">rank 0</text>" in html and ">rank 1</text>" in html and ">step</text>" in html
    assert "currentColor" in html and "<script" not in html  # the theme's text colour; static SVG

    out = kernel.ok("""import nbddp
df = nbddp.metrics()
print(list(df.columns), len(df))
print(sorted(df.groupby('rank').size().tolist()), df['step'].max(), df['cell'].nunique())
import math
err = max(abs(r.loss - (math.exp(-r.step / 50) + r.rank / 100)) for r in df.itertuples())
print('maxerr', err, (df['lr'] == 0.1).all())
""").stdout
    assert "['cell', 'rank', 'step', 'time', 'loss', 'lr'] 400" in out, out
    assert "[200, 200] 199 1" in out and "maxerr 0.0 True" in out, out

    run_dir = re.search(r"logs: (\S+)", res.displays[0]["data"]["text/plain"]).group(1)
    csv = kernel.ok(f"print(open({run_dir + '/metrics.csv'!r}).read().splitlines()[:2], "
                    f"len(open({run_dir + '/metrics.csv'!r}).read().splitlines()))").stdout
    assert "'cell,rank,step,time,loss,lr'" in csv and csv.strip().endswith("401"), csv


def test_the_numbers_of_a_tqdm_bars_postfix_are_charted_at_its_step(kernel):
    res = kernel.run("""%%ddp --devices 2
from tqdm.auto import tqdm
bar = tqdm(range(30), mininterval=0)
for i in bar:
    bar.set_postfix(loss=1.0 / (i + 1), refresh=True)
""", timeout=120)
    assert res.error is None, res
    final = chart_displays(res)[-1]
    assert "loss: rank 0 0.0333 (step 30) · rank 1 0.0333 (step 30)" in final["text/plain"], final["text/plain"]
    out = kernel.ok("df = nbddp.metrics(); cell = df[df.cell == df.cell.iloc[-1]]\n"
                    "print(sorted(cell.columns[4:]), cell.groupby('rank').step.nunique().tolist(), "
                    "round(cell[(cell['rank'] == 0)].dropna(subset=['loss']).sort_values('step').loss.iloc[-1], 4))"
                    ).stdout
    assert "'loss'" in out, out
    counts = [int(n) for n in re.search(r"\[(\d+), (\d+)\]", out).groups()]
    assert min(counts) >= 20, out  # a row per step the bar drew (tqdm's own rate limits stay)
    assert out.strip().endswith("0.0333"), out  # its last postfix: loss=1/30


def test_a_rank_that_takes_50_ms_more_a_step_is_named_slow(kernel):
    res = kernel.run("""%%ddp --devices 2
import time, nbddp
for step in range(40):
    time.sleep(0.06 if rank == 1 else 0.01)
    nbddp.log(step=step, loss=1.0)
""", timeout=120)
    assert res.error is None, res
    text = chart_displays(res)[-1]["text/plain"]
    assert re.search(r"rank 1: \d\.\d× the median step time", text), text
    assert "rank 0:" not in text


def test_a_pool_curve_goes_on_across_cells_and_status_names_the_slow_rank_of_a_background_cell():
    with Kernel() as k:
        k.ok("%load_ext nbddp")
        k.ok("%ddp start --devices 2")
        for first in (0, 50):
            res = k.run(f"""%%ddp
import nbddp
for step in range({first}, {first + 50}):
    nbddp.log(step=step, loss=1.0 / (step + 1))
""", timeout=120)
            assert res.error is None, res
            assert chart_displays(res) and "(step %d)" % (first + 49) in chart_displays(res)[-1]["text/plain"]
        out = k.ok("import nbddp; df = nbddp.metrics(); print(df.groupby('cell').step.agg(['min', "
                   "'max']).values.tolist(), len(df))").stdout
        assert "[[0, 49], [50, 99]] 200" in out, out

        k.ok("""%%ddp --bg
import time, nbddp
for step in range(200):
    time.sleep(0.08 if rank == 1 else 0.02)
    nbddp.log(step=step, loss=1.0)
""")
        deadline = time.monotonic() + 60
        status = ""
        while time.monotonic() < deadline:
            status = k.ok("%ddp status").displays[-1]["data"]["text/plain"]
            if "slow: rank 1" in status:
                break
            k.ok("import time; time.sleep(0.5)")
        assert "slow: rank 1:" in status and "× the median step time" in status, status
        k.ok("%ddp wait")
        attached = k.run("%ddp attach", timeout=120)  # the background cell's output again: its line and charts
        line = next(d["data"] for d in attached.displays if "nbddp-line" in d.get("data", {}).get("text/html", ""))
        assert "nbddp-charts" in line["text/html"], line
        assert "loss: rank 0 1 (step 199) · rank 1 1 (step 199)" in line["text/plain"], line
        k.ok("%ddp stop")


# -- the parts, directly ------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_batch_is_one_column_per_name_with_nan_where_a_call_did_not_log_it():
    rec = metrics_log._columns([(0, 1.0, {"loss": 2.0}), (1, 2.0, {"lr": 0.1}), (2, 3.0, {"loss": 1.0, "lr": 0.2}),
                            (3, 4.0, {"note": "text"})])
    assert rec.steps == (0, 1, 2) and rec.times == (1.0, 2.0, 3.0)
    assert rec.values["loss"][0] == 2.0 and math.isnan(rec.values["loss"][1]) and rec.values["loss"][2] == 1.0
    assert math.isnan(rec.values["lr"][0]) and rec.values["lr"][1:] == (0.1, 0.2)


@pytest.mark.unit
def test_outside_a_rank_log_does_nothing_and_costs_next_to_nothing():
    assert metrics_log._state["chan"] is None
    start = time.perf_counter()
    for _ in range(10_000):
        metrics_log.log(loss=1.0)
    assert not metrics_log._queue
    assert (time.perf_counter() - start) / 10_000 < 10e-6


@pytest.mark.unit
def test_a_series_keeps_at_most_max_points_and_always_its_last():
    s = metrics_chart.Series()
    for start in range(0, 100_000, 2500):  # batches, as the ranks send them
        s.extend(list(range(start, start + 2500)), [float(i) for i in range(start, start + 2500)])
    s.extend([100_000, 100_001], [math.nan, 5.0])  # (NaN: not logged at that step)
    pts = s.points()
    assert len(pts) <= metrics_chart.MAX_POINTS + 1 and pts[0] == (0, 0.0) and pts[-1] == (100_001, 5.0)
    steps = [p[0] for p in pts[:-1]]
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    assert len(gaps) <= 2 and max(gaps) <= 2 * min(gaps), gaps  # evenly spread over the run


@pytest.mark.unit
def test_past_eight_ranks_a_panel_draws_median_band_and_outliers():
    chart = metrics_chart.Chart()
    for rank in range(12):
        chart.add(rank, messages.Scalars((0, 1, 2), (0.0, 1.0, 2.0), {"loss": (1.0, 0.5, 9.0 if rank == 7 else 0.2)}))
    html = chart.html()
    assert "median of 12 ranks" in html and "<polygon" in html and ">rank 7</text>" in html
    assert "median 0.2, 0.2 to 9" in chart.text()


@pytest.mark.unit
def test_the_slow_rank_is_named_at_125_percent_of_the_median_not_below():
    assert metrics_chart.slow_rank({0: 0.10, 1: 0.10, 2: 0.124}) is None
    said = metrics_chart.slow_rank({0: 0.10, 1: 0.10, 2: 0.16})
    assert said.startswith("rank 2: 1.6× the median step time"), said
    assert metrics_chart.slow_rank({0: 0.1}) is None


@pytest.mark.unit
def test_a_bars_postfix_numbers_are_its_scalars():
    bar = messages.Progress(0, {"n": 5, "postfix": "loss=0.310, lr=1e-3, tag=x"}, "")
    assert bar.scalars == {"loss": 0.31, "lr": 0.001}
    seen = {}
    assert metrics_chart.logged(0, bar, seen).values == {"loss": (0.31,), "lr": (0.001,)}
    assert metrics_chart.logged(0, bar, seen) is None  # a redraw at the same step adds nothing


# -- where users already log: Hugging Face Trainer, Lightning ---------------------------------------
HF_CELL = """%%ddp --devices 2
import torch, nbddp.integrations
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
    num_attention_heads=2, intermediate_size=32, max_position_embeddings=16, num_labels=2))
class Toy(torch.utils.data.Dataset):
    def __len__(self):
        return 32
    def __getitem__(self, i):
        x = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x.sum() % 2}
args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=4, num_train_epochs=1, logging_steps=1,
                         report_to=[], use_cpu=True, disable_tqdm=True, save_strategy='no', seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Toy(), callbacks=[nbddp.integrations.NbddpCallback()])
trainer.train()
print('losses', len([h for h in trainer.state.log_history if 'loss' in h]), trainer.state.global_step)
"""

LIGHTNING_CELL = """%%ddp --devices 2
import torch, pytorch_lightning as pl, nbddp.integrations
class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log('train_loss', loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = pl.Trainer(accelerator='cpu', devices=2, strategy='ddp', max_epochs=1, log_every_n_steps=1,
                     logger=nbddp.integrations.NbddpLogger(), enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=8))
print('steps', trainer.global_step)
"""


def logged_by_rank(k, column: str) -> str:
    return k.ok(f"import nbddp; df = nbddp.metrics(); df = df[df.cell == df.cell.iloc[-1]]\n"
                f"print(df.dropna(subset=[{column!r}]).groupby('rank').step.agg(['count', 'max']).values.tolist())"
                ).stdout


def test_a_hugging_face_trainers_logs_reach_the_charts_through_nbddps_callback(tmp_path):
    pytest.importorskip("transformers")  # (the README's stack has it; a hosted look-alike need not)
    with Kernel() as k:
        k.ok("%load_ext nbddp")
        res = k.run(HF_CELL.replace("OUT", repr(str(tmp_path))), timeout=240)
        assert res.error is None and "losses 4 4" in res.stdout, res
        assert chart_displays(res) and "loss: rank 0" in chart_displays(res)[-1]["text/plain"], res
        assert logged_by_rank(k, "loss").strip() == "[[4, 4], [4, 4]]"  # 32 samples, 2 ranks x 4 a step: 4 steps


def test_lightnings_self_log_reaches_the_charts_through_nbddps_logger():
    pytest.importorskip("pytorch_lightning")
    with Kernel() as k:
        k.ok("%load_ext nbddp")
        k.ok("import pytorch_lightning  # imported in the notebook first: Lightning then believes it is interactive")
        res = k.run(LIGHTNING_CELL, timeout=240)
        assert res.error is None and "steps 4" in res.stdout, res
        assert chart_displays(res) and "train_loss: rank 0" in chart_displays(res)[-1]["text/plain"], res
        counts = logged_by_rank(k, "train_loss").strip()
        assert counts.startswith("[[") and counts.count("[") == 3, counts  # both ranks logged


@pytest.mark.unit
def test_metrics_csv_is_appended_cell_by_cell_and_written_anew_when_a_name_first_appears(tmp_path):
    from nbddp.kernel.metrics import Logbook

    store, run = Logbook(), str(tmp_path)
    store.add("In [1]", run, 0, messages.Scalars((0, 1), (1.0, 2.0), {"loss": (2.0, 1.0)}))
    store.add("In [1]", "elsewhere", 0, messages.Scalars((0,), (1.0,), {"other": (9.0,)}))
    store.write_csv(run)
    store.add("In [2]", run, 1, messages.Scalars((2,), (3.0,), {"loss": (0.5,)}))
    store.write_csv(run)  # appended
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "cell,rank,step,time,loss", "In [1],0,0,1.0,2.0", "In [1],0,1,2.0,1.0", "In [2],1,2,3.0,0.5"]
    store.add("In [3]", run, 0, messages.Scalars((3,), (4.0,), {"loss": (0.25,), "lr": (0.1,)}))
    store.write_csv(run)  # a new name: the file anew, with its column
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "cell,rank,step,time,loss,lr" and lines[1] == "In [1],0,0,1.0,2.0,"
    assert lines[-1] == "In [3],0,3,4.0,0.25,0.1"
    assert len(lines) == 5


@pytest.mark.unit
def test_a_kept_pools_metrics_csv_is_the_next_kernels_history_and_its_new_rows_are_appended(tmp_path):
    """A kept pool taken by a new kernel (taking.taken): the run's metrics.csv, as the dead kernel wrote it, filed
    again (nbddp.metrics() and the charts carry the curves on), and what follows appended to the same file."""
    from nbddp.kernel.metrics import Logbook

    run = str(tmp_path)
    dead = Logbook()
    dead.add("In [1]", run, 0, messages.Scalars((0, 1), (1.0, 2.0), {"loss": (2.0, 1.0)}))
    dead.add("In [1]", run, 1, messages.Scalars((0,), (1.5,), {"loss": (2.5,), "lr": (0.1,)}))
    dead.write_csv(run)
    taken = Logbook()
    assert taken.load_csv(run) == 3 and taken.load_csv(str(tmp_path / "none")) == 0
    assert taken.columns(run) == dead.columns(run) or str(taken.columns(run)) == str(dead.columns(run))  # (NaN)
    taken.add("In [4]", run, 0, messages.Scalars((2,), (3.0,), {"loss": (0.5,)}))
    taken.write_csv(run)
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "cell,rank,step,time,loss,lr", "In [1],0,0,1.0,2.0,", "In [1],0,1,2.0,1.0,", "In [1],1,0,1.5,2.5,0.1",
        "In [4],0,2,3.0,0.5,"]


@pytest.mark.unit
def test_an_infinite_or_missing_value_is_left_out_of_the_drawing_and_never_breaks_it():
    chart = metrics_chart.Chart()
    chart.add(0, messages.Scalars((0, 1, 2), (0.0, 1.0, 2.0), {"loss": (1.0, math.inf, 0.5), "gn": (math.nan,) * 3}))
    assert "<svg" in chart.html() and "loss: rank 0 0.5 (step 2)" in chart.text()
    many = metrics_chart.Chart()
    for rank in range(10):  # past MAX_LINES ranks, every value of a name missing: nothing to draw, no exception
        many.add(rank, messages.Scalars((0,), (0.0,), {"gn": (math.nan,)}))
    assert many.html() == "" or "<svg" not in many.html()


@pytest.mark.unit
def test_a_scalar_named_as_a_column_is_kept_beside_it(tmp_path):
    from nbddp.kernel.metrics import Logbook

    store = Logbook()
    store.add("In [1]", str(tmp_path), 0, messages.Scalars((7,), (1.0,), {"step": (3.0,), "loss": (0.5,)}))
    cols = store.columns()
    assert cols["step"] == [7] and cols["step_"] == [3.0] and cols["loss"] == [0.5]


@pytest.mark.unit
def test_a_batch_that_cannot_be_sent_never_reaches_the_cell(monkeypatch):
    class Gone:
        def send(self, record):
            raise BrokenPipeError("the kernel is gone")

    monkeypatch.setitem(metrics_log._state, "chan", Gone())
    metrics_log.log(loss=10 ** 400)  # (no float can hold it: left out, said once)
    metrics_log.log(loss=1.0)
    metrics_log.flush()  # neither the value nor the pipe raises
    assert not metrics_log._queue
