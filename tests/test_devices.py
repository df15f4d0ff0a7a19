"""Device strings (Lightning's table) and plans, with NVML and CUDA replaced at their seams."""
import pytest

from helpers import FakeNvml
from nbddp.errors import UsageError
from nbddp.hw import cuda, nvml
from nbddp.kernel import devices


class CudaBuilt(cuda.Cuda):
    def built(self):
        return True


class CpuBuild(cuda.Cuda):  # torch without CUDA, whatever build this machine has
    def built(self):
        return False


@pytest.fixture
def gpus(monkeypatch):
    def use(n, built=True):
        monkeypatch.setattr(nvml, "_backend", FakeNvml(n))
        monkeypatch.setattr(cuda, "_backend", CudaBuilt() if built else CpuBuild())

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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_gpus_with_a_cpu_build_of_torch(gpus):
    gpus(2, built=False)
    assert devices.plan("auto").accelerator == "cpu"  # auto falls back to what torch can drive
    with pytest.raises(UsageError, match="no CUDA support"):
        devices.plan(2, "cuda")


@pytest.mark.unit
def test_nvml_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,GPU-abc,1")
    assert nvml._visible(4) == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvml._visible(4) == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml._visible(3) == [0, 1, 2]


# -- free GPUs: picked through the NVML seam ------------------------------------------------------------
GIB = 2**30


def use(i, *, procs=(), used=0.3, mode="default", mig=False, total=80):
    return nvml.GpuUse(i, f"Fake GPU {i}", int(used * GIB), total * GIB, tuple(procs), mode, mig)


@pytest.fixture
def shared(monkeypatch):
    def use_gpus(*uses):
        monkeypatch.setattr(nvml, "_backend", FakeNvml(len(uses), uses=uses))
        monkeypatch.setattr(cuda, "_backend", CudaBuilt())

    return use_gpus


@pytest.mark.unit
def test_auto_uses_the_free_gpus_and_says_which_it_skipped_and_why(shared):
    shared(use(0, procs=[(999_001, 30 * GIB)]), use(1), use(2, used=60), use(3))
    p = devices.plan("auto")
    assert p.device_ids == (1, 3)
    (note,) = p.notes
    assert "--devices auto uses the free GPUs cuda:1, cuda:3; skipped:" in note
    assert "cuda:0  1 other compute process on it (pid 999001 30.0 GiB)" in note
    assert "cuda:2  60.0 GiB of its 80.0 GiB memory is in use (over 10%" in note


@pytest.mark.unit
def test_all_free_means_no_notes(shared):
    shared(use(0), use(1))
    assert devices.plan("auto") == devices.Plan("cuda", "nccl", (0, 1)) and devices.plan("auto").notes == ()


@pytest.mark.unit
def test_a_count_picks_that_many_free_gpus(shared):
    shared(use(0, procs=[(999_001, None)]), use(1), use(2), use(3))
    p = devices.plan(2)
    assert p.device_ids == (1, 2)
    assert "skipped:\n  cuda:0  1 other compute process on it (pid 999001)" in p.notes[0]
    assert devices.plan(1).device_ids == (1,)


@pytest.mark.unit
def test_a_count_beyond_the_free_gpus_is_refused_with_each_gpus_state(shared):
    shared(use(0, procs=[(999_001, GIB), (999_002, GIB)]), use(1))
    with pytest.raises(UsageError) as e:
        devices.plan(2)
    text = str(e.value)
    assert "--devices 2 asks for 2 free GPUs, but 1 of 2 are free:" in text
    assert "cuda:0  2 other compute processes on it" in text and "cuda:1  free" in text
    assert "Use --devices 1 (the free ones), or --devices 0,1 (GPUs named by index are used even if busy)" in text


@pytest.mark.unit
def test_auto_with_no_free_gpu_is_refused(shared):
    shared(use(0, mode="prohibited"), use(1, used=79))
    with pytest.raises(UsageError) as e:
        devices.plan("auto")
    text = str(e.value)
    assert "--devices auto found no free GPU:" in text
    assert "cuda:0  its compute mode is Prohibited" in text and "cuda:1  79.0 GiB" in text
    assert "Use --devices 0,1 (GPUs named by index are used even if busy), or wait" in text


@pytest.mark.unit
def test_explicit_indices_are_used_as_given_with_a_warning_when_busy(shared):
    shared(use(0), use(1, procs=[(999_001, 2 * GIB)], mode="exclusive_process"))
    p = devices.plan("0,1")
    assert p.device_ids == (0, 1)
    (note,) = p.notes
    assert note.startswith("nbddp: warning: cuda:1 is busy: 1 other compute process on it (pid 999001 2.0 GiB)")
    assert "exclusive-process mode, so a rank could not create a context there" in note
    assert "using it as asked (--devices 0,1)" in note
    assert devices.plan("0,").notes == ()
    assert "(--devices 1,)" in devices.plan([1]).notes[0]  # "1" alone would be a count


@pytest.mark.unit
def test_minus_one_means_all_gpus_busy_or_not(shared):
    shared(use(0, used=50), use(1))
    p = devices.plan(-1)
    assert p.device_ids == (0, 1) and "cuda:0 is busy" in p.notes[0] and "(--devices -1)" in p.notes[0]


@pytest.mark.unit
def test_exclusive_process_mode_without_a_process_is_free(shared):
    shared(use(0, mode="exclusive_process"), use(1, mode="exclusive_thread"))
    assert devices.plan("auto").device_ids == (0, 1)


@pytest.mark.unit
def test_the_kernels_own_processes_do_not_make_a_gpu_busy(shared):
    import os

    shared(use(0, procs=[(os.getpid(), GIB)]), use(1))
    assert devices.plan("auto").device_ids == (0, 1)


@pytest.mark.unit
def test_mig_gpus_are_judged_by_their_instances_and_said(shared):
    shared(use(0, mig=True), use(1, mig=True, procs=[(999_001, GIB)]), use(2))
    p = devices.plan("auto")
    assert p.device_ids == (0, 2)
    assert "cuda:1  1 other compute process" in p.notes[0]
    assert "cuda:0 is in MIG mode: a rank there sees one MIG instance" in p.notes[1]
    assert devices.plan("0,").notes == (p.notes[1],)  # said for named GPUs too


@pytest.mark.unit
def test_memory_threshold_is_one_fact(shared, monkeypatch):
    from nbddp.hw import gpufree

    shared(use(0, used=8), use(1, used=8.5))  # 10% of 80 GiB is 8 GiB
    assert devices.plan("auto").device_ids == (0,)
    monkeypatch.setattr(gpufree, "BUSY_MEMORY_FRACTION", 0.5)
    assert devices.plan("auto").device_ids == (0, 1)


@pytest.mark.unit
def test_unknown_usage_counts_as_free(shared, gpus):
    shared(nvml.GpuUse(0, "Fake GPU 0", None, None, None, "unknown"), use(1))
    assert devices.plan("auto").device_ids == (0, 1)
    gpus(3)  # a stand-in without usage(): every GPU counts as free
    assert devices.plan("auto").device_ids == (0, 1, 2)


@pytest.mark.unit
def test_a_count_larger_than_the_machine_names_the_gpus(shared):
    shared(use(0), use(1))
    with pytest.raises(UsageError, match="asks for GPU 2, 3, but this machine has 2"):
        devices.plan(4)
