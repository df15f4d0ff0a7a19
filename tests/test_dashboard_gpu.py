"""The dashboard's GPU rows, with NVML replaced at its seam (no GPU here)."""
import os
from types import SimpleNamespace

import pytest

from helpers import FakeNvml
from nbddp.hw import nvml
from nbddp.kernel import devices
from nbddp.kernel.ranks.failure import RankExit
from nbddp.kernel.ranks.supervisor import Output, Started
from nbddp.views import dashboard

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)


def test_gpu_utilisation_and_memory_per_rank_live_and_peak_at_the_end(monkeypatch, tmp_path):
    fake = FakeNvml(2, "Fake H100", readings=True)
    monkeypatch.setattr(nvml, "_backend", fake)
    view = dashboard.RunView(live=False)
    view.begin(devices.Plan("cuda", "nccl", (0, 1)), SimpleNamespace(path=tmp_path))
    for r in (0, 1):
        view.on_Output(Output(r, "stdout", f"epoch 2\nepoch 3 loss 0.{r + 1}\r".encode()))
    for r in (0, 1):
        view.on_Started(Started(r, os.getpid()))  # a real process to sample; its GPU figures come from the seam
    for _ in range(5):
        view.tick()
    live = view.render_text()
    row1 = next(line for line in live.splitlines() if line.startswith("1 "))
    assert "51% · 25.0 GiB / 80.0 GiB" in row1, live  # rank 1's device at the 5th sample
    assert row1.endswith("epoch 3 loss 0.2"), live  # rank 1's last line, from its output events
    assert "GPU" in view.render_html() and "W" not in live and "°C" not in live  # no power or temperature
    for r in (0, 1):
        view.exited(r, RankExit(r, 0, done=True, max_rss=3 * 2**30))
    view.finish(None)
    text = view.render_text()
    assert "25.0 GiB / 80.0 GiB peak" in text and "nccl" in text and "finished" in text
    assert "%" not in text.split("\n", 1)[1], "no utilisation once the ranks are gone"


def test_the_pool_view_keeps_gpu_and_memory_history_over_the_pools_life(monkeypatch, tmp_path):
    from nbddp.views import poolview

    fake = FakeNvml(2, "Fake H100", readings=True)
    monkeypatch.setattr(nvml, "_backend", fake)
    view = poolview.PoolView(devices.Plan("cuda", "nccl", (0, 1)), SimpleNamespace(path=tmp_path), shown=False)
    for r in (0, 1):
        view.on_Started(Started(r, os.getpid()))
    view.cell_began("Cell In[4]")
    assert "busy: Cell In[4]" in view.render_text()
    for _ in range(poolview.SERIES_MAX + 8):  # past the bound: every other point goes, the whole life stays
        view.sample()
    view.cell_ended("ok")
    text = view.render_text()
    assert "idle" in text and "busy" not in text and "Cell In[4] · " in text and " · ok" in text
    assert len(view.gpu_util[0].values) <= poolview.SERIES_MAX
    assert view.gpu_util[1].values[0] == 11.0, "the first sample is still there"
    gpu = next(line for line in text.splitlines() if line.startswith("cuda:1"))
    assert len(gpu.split()[1]) <= poolview.SPARK_WIDTH and gpu.split()[1].endswith("█")  # utilisation rose
    assert "21.0 GiB–" in gpu  # memory over the pool's life, with its range from the first sample on
    for r in (0, 1):
        assert f"cuda:{r}" in [line.split()[2] for line in text.splitlines() if line.startswith(f"{r} ")]
