"""The real NVML adapter (nbddp.nvml.Nvml) against a pynvml stand-in with nvidia-ml-py's documented API."""
import sys
import types

import pytest

from nbddp import nvml


@pytest.fixture
def fake_pynvml(monkeypatch):
    calls = []
    mod = types.ModuleType("pynvml")
    mod.NVML_TEMPERATURE_GPU = 0
    mod.nvmlInit = lambda: calls.append("init")
    mod.nvmlDeviceGetCount = lambda: 4
    mod.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    mod.nvmlDeviceGetName = lambda h: f"GPU {h[-1]}".encode()  # older bindings return bytes
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=10 * int(h[-1]), memory=0)
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30, total=16 * 2**30, free=15 * 2**30)

    def power(h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # e.g. on some consumer boards

    mod.nvmlDeviceGetPowerUsage = power
    mod.nvmlDeviceGetTemperature = lambda h, sensor: 55
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return calls


def test_counts_names_and_samples_visible_gpus(fake_pynvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    n = nvml.Nvml()
    assert n.count() == 2
    assert n.names() == ["GPU 3", "GPU 1"]
    s0, s1 = n.sample([0, 1])
    assert (s0.index, s0.name, s0.util_percent, s0.mem_used, s0.mem_total) == (0, "GPU 3", 30.0, 2**30, 16 * 2**30)
    assert s1.name == "GPU 1" and s1.util_percent == 10.0
    assert s0.power_w is None and s0.temp_c == 55.0  # an unsupported query is a gap, not an error
    assert fake_pynvml == ["init"]  # initialised once


def test_no_pynvml_means_no_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    n = nvml.Nvml()
    assert n.count() == 0 and n.names() == [] and n.sample([0]) == []
