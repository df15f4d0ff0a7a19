"""The real NVML adapter (nbddp.hw.nvml.Nvml) against a pynvml stand-in with nvidia-ml-py's documented API."""
import sys
import types

import pytest

from nbddp.hw import nvml

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)


@pytest.fixture
def fake_pynvml(monkeypatch):
    calls = []
    mod = types.ModuleType("pynvml")
    mod.NVMLError = RuntimeError  # (nvidia-ml-py's NVMLError_NotSupported, NoPermission... are all NVMLError)
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


def _proc(pid, used):
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


@pytest.fixture
def shared_pynvml(fake_pynvml, monkeypatch):
    """GPU 0: busy in exclusive-process mode; GPU 1: MIG with two instances (the parent answers only to
    root, as NVML documents); GPU 2: compute mode and process list not supported."""
    mod = sys.modules["pynvml"]
    monkeypatch.setattr(mod, "nvmlDeviceGetCount", lambda: 3)

    def need(h, allowed):
        if h not in allowed:
            raise RuntimeError("NVML_ERROR_NO_PERMISSION")

    mem = {"handle0": (30, 80), "mig1a": (2, 40), "mig1b": (5, 40), "handle2": (0.5, 16)}
    mod.nvmlDeviceGetMemoryInfo = lambda h: (need(h, mem), types.SimpleNamespace(
        used=int(mem[h][0] * 2**30), total=mem[h][1] * 2**30))[1]
    procs = {"handle0": [_proc(4242, 30 * 2**30)], "mig1a": [], "mig1b": [_proc(777, None)]}
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: (need(h, procs), procs[h])[1]
    modes = {"handle0": 3, "handle1": 0}
    mod.nvmlDeviceGetComputeMode = lambda h: (need(h, modes), modes[h])[1]
    mod.nvmlDeviceGetMigMode = lambda h: (1, 1) if h == "handle1" else (0, 0)
    mod.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7

    def mig_instance(h, i):
        if i > 1:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")  # an empty slot
        return ("mig1a", "mig1b")[i]

    mod.nvmlDeviceGetMigDeviceHandleByIndex = mig_instance
    return mod


def test_usage_reads_processes_memory_compute_and_mig_modes(shared_pynvml):
    g0, g1, g2 = nvml.Nvml().usage()
    assert g0 == nvml.GpuUse(0, "GPU 0", 30 * 2**30, 80 * 2**30, ((4242, 30 * 2**30),), "exclusive_process", False)
    assert g1.mig and g1.mem_used == 7 * 2**30 and g1.mem_total == 80 * 2**30  # summed over its MIG instances
    assert g1.processes == ((777, None),)  # usedGpuMemory unavailable: a gap, not an error
    assert g1.compute_mode == "default"
    assert g2.processes is None and g2.compute_mode == "unknown" and g2.mem_used == 2**29


def test_usage_through_the_free_gpu_pick(shared_pynvml, monkeypatch):
    from nbddp.hw import gpufree

    monkeypatch.setattr(nvml, "_backend", nvml.Nvml())
    found = gpufree.survey(3)
    assert found.free() == [2]  # unknown processes count as none; 0.5 of 16 GiB is under the threshold
    assert "pid 4242" in found.busy[0] and "exclusive-process mode" in found.busy[0]
    assert found.busy[1].startswith("1 other compute process on it (pid 777") and found.mig == (1,)


def test_no_pynvml_means_no_usage(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert nvml.Nvml().usage() == []
