"""Device strings (Lightning's table) and plans, with NVML and CUDA replaced at their seams."""
import pytest

from nbddp import cuda, devices, nvml
from nbddp.errors import UsageError


class FakeNvml:
    def __init__(self, n):
        self.n = n

    def count(self):
        return self.n

    def names(self):
        return [f"Fake GPU {i}" for i in range(self.n)]

    def sample(self, indices):
        return []


class CudaBuilt(cuda.Cuda):
    def built(self):
        return True


@pytest.fixture
def gpus(monkeypatch):
    def use(n, built=True):
        monkeypatch.setattr(nvml, "_backend", FakeNvml(n))
        monkeypatch.setattr(cuda, "_backend", CudaBuilt() if built else cuda.Cuda())

    return use


@pytest.mark.parametrize(
    "spec, parsed",
    [(3, 3), ("3", 3), (" 2 ", 2), (-1, -1), ("-1", -1), ("auto", "auto"), ("AUTO", "auto"),
     ([1, 3], [1, 3]), ("1,3", [1, 3]), ("1, 3", [1, 3]), ("0,", [0]), ((0, 2), [0, 2])],
)
def test_device_strings_follow_lightnings_table(spec, parsed):
    assert devices.parse_devices(spec) == parsed


@pytest.mark.parametrize(
    "spec, message",
    [("banana", "not a device spec"), ("1,1", "more than once"), ([0, 2, 2], "device 2 more than once"),
     (0, "at least one"), (-2, "at least one"), ("-3", "at least one"), ("0,-1", "cannot be negative"),
     (",", "names no device"), ("1.5", "not a device spec")],
)
def test_bad_device_strings_are_refused(spec, message):
    with pytest.raises(UsageError, match=message):
        devices.parse_devices(spec)


def test_cpu_plans(gpus):
    gpus(0)
    assert devices.plan(2) == devices.Plan("cpu", "gloo", (None, None))
    assert devices.plan("auto").world_size == 1
    with pytest.raises(UsageError, match="counted, not indexed"):
        devices.plan("0,1", "cpu")
    with pytest.raises(UsageError, match="--backend nccl needs GPUs"):
        devices.plan(2, "cpu", "nccl")
    with pytest.raises(UsageError, match="NVML sees no GPU"):
        devices.plan(2, "cuda")
    with pytest.raises(UsageError, match="choose one of"):
        devices.plan(2, "tpu")


def test_gpu_plans_through_the_nvml_seam(gpus):
    gpus(4)
    assert devices.plan("auto") == devices.Plan("cuda", "nccl", (0, 1, 2, 3))
    assert devices.plan(-1).device_ids == (0, 1, 2, 3)
    assert devices.plan("1,3").device_ids == (1, 3)
    assert devices.plan(2, backend="gloo") == devices.Plan("cuda", "gloo", (0, 1))
    assert devices.plan(2, "cpu").accelerator == "cpu"
    with pytest.raises(UsageError) as e:
        devices.plan("2,5")
    assert "GPU 5" in str(e.value) and "cuda:3  Fake GPU 3" in str(e.value) and "--devices 4" in str(e.value)


def test_gpus_with_a_cpu_build_of_torch(gpus):
    gpus(2, built=False)
    assert devices.plan("auto").accelerator == "cpu"  # auto falls back to what torch can drive
    with pytest.raises(UsageError, match="no CUDA support"):
        devices.plan(2, "cuda")


def test_nvml_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,GPU-abc,1")
    assert nvml._visible(4) == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvml._visible(4) == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml._visible(3) == [0, 1, 2]
