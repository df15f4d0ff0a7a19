"""The CUDA guard, in real kernels, with NVML replaced at its seam and a stand-in CUDA driver (a tiny
shared object named libcuda.so.1, built here with gcc) loaded by stand-in libraries in notebook cells."""
import pytest

from helpers import fake_nvml_in_kernel
from kernel import Kernel, said
from standin_driver import build

pytestmark = pytest.mark.timeout(180)

FAKE_NVML = fake_nvml_in_kernel(2, "Fake H100")  # 2 GPUs, no readings, every one free


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build(tmp_path_factory.mktemp("standin"))


@pytest.fixture
def fresh(standin, runs_dir):
    """A fresh kernel per call (a loaded driver cannot be unloaded), with the stand-in driver's libraries
    importable, nbddp loaded and told the stand-in's device directory; every child is checked and killed."""
    kernels = []

    def start(*, device_file=True, before_load=""):
        k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir), **standin.env(device_file=device_file)})
        kernels.append(k)
        k.ok(f"import nbddp.hw.driverwatch\nnbddp.hw.driverwatch.Watcher.device_prefixes = "
             f"({str(standin.devdir / 'nvidia')!r},)  # where the stand-in's device file is")
        if before_load:
            k.ok(before_load)
        k.ok("%load_ext nbddp\n" + FAKE_NVML + "guard = nbddp.hw.cuda.backend()\nguard.built = lambda: True\n")
        return k

    yield start
    for k in kernels:
        left = k.process().children(recursive=True)
        k.shutdown()
        assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


def refused(k, runs_dir):
    before = set(runs_dir.iterdir())
    res = k.run("%%ddp --devices 2 --start-method fork\nprint('must not run')\n")
    assert res.error and res.error["ename"] == "CudaInitialisedError", res.error_text + res.stdout
    assert "must not run" not in res.stdout
    assert set(runs_dir.iterdir()) == before  # nothing was launched
    return res.error_text


def cell_number(k) -> int:
    """The number of the cell run just before this call (this call's own cell is the next one)."""
    return k.value("len(In)") - 2  # IPython stored this cell's input before running it (every version)


def test_guard_names_the_cell_and_the_library_that_initialised_cuda(fresh, runs_dir):
    k = fresh()
    k.ok("x = 1\nimport gpulib_ctypes  # loads the driver and calls cuInit\n")
    n = cell_number(k)
    text = refused(k, runs_dir)
    assert f"CUDA was initialised in this kernel by In [{n}]: import gpulib_ctypes" in text
    assert "(module gpulib_ctypes)" in text
    assert "move `import gpulib_ctypes  # loads the driver and calls cuInit` into the %%ddp cell" in text
    assert "run %load_ext nbddp before import gpulib_ctypes" in text and "PYTORCH_NVML_BASED_CUDA_CHECK=1" in text
    assert "drop --start-method fork" in text
    assert len(text.splitlines()) <= 12  # one screen


def test_guard_names_a_library_that_loads_the_driver_from_native_code(fresh, runs_dir):
    k = fresh()
    k.ok("import gpulib_native\n")  # ctypes loads its own library, which is linked against the driver
    n = cell_number(k)
    text = refused(k, runs_dir)
    assert f"by In [{n}]: import gpulib_native (module gpulib_native)" in text
    assert "move `import gpulib_native` into the %%ddp cell" in text


def test_a_loaded_driver_is_fine_until_a_cell_initialises_it(fresh, runs_dir):
    k = fresh()
    assert k.value("nbddp.hw.driverwatch.driver_mapped() is None")
    assert k.value("guard.refusal() is None")  # no driver here, and nbddp did not load one to find out
    assert k.value("nbddp.hw.driverwatch.driver_mapped() is None")
    k.ok("import gpulib_lazy  # loads the driver, initialises nothing\n")
    assert k.value("nbddp.hw.driverwatch.driver_mapped() is not None")
    assert k.value("guard.refusal() is None")  # the throwaway child could initialise it: forking is safe
    assert k.value("gpulib_lazy.initialised()") is False  # the probe ran in the child, not in the kernel
    k.ok("y = 2\ngpulib_lazy.init()\n")
    n = cell_number(k)
    text = refused(k, runs_dir)
    assert f"CUDA was initialised in this kernel by In [{n}]: y = 2" in text


def test_device_files_nvml_opened_are_no_cuda_context(fresh, standin, runs_dir):
    """Seen on an H100: NVML (nbddp's dashboard, torch's NVML-based is_available) opens the same device
    files as cuInit, and torch 2.11 maps the driver on import. Neither may refuse a GPU cell."""
    k = fresh()
    k.ok("import gpulib_lazy  # the driver mapped, as `import torch` does with torch 2.11's CUDA wheels\n")
    ctl = standin.devdir / "nvidiactl"
    k.ok(f"with nbddp.hw.driverwatch.not_cuda():  # as the NVML seam opens them\n    "
         f"nvml_fd = open({str(ctl)!r}, 'w')\n")
    assert k.value("guard.watch.devices") == [] and k.value("guard.watch.initialised is None")
    assert k.value("guard.refusal() is None")
    k.ok(f"other_fd = open({str(ctl)!r}, 'a')  # NVML opened by someone else (torch's own check, pynvml)\n")
    assert k.value("guard.watch.devices") == [str(ctl)]  # a sighting, kept to name the cell if it comes to that
    assert k.value("guard.refusal() is None"), "an open device file alone is no context: the probe decides"
    k.ok("y = 2\ngpulib_lazy.init()\n")
    n = cell_number(k)
    text = refused(k, runs_dir)
    assert f"CUDA was initialised in this kernel by In [{n}]: y = 2" in text  # not the cell that opened NVML


def test_the_fork_probe_catches_an_initialisation_no_device_file_shows(fresh, runs_dir):
    k = fresh(device_file=False)  # cuInit that opens no device file nbddp can see
    k.ok("import gpulib_ctypes\n")
    n = cell_number(k)
    assert k.value("guard.watch.devices") == []
    text = refused(k, runs_dir)
    assert f"by In [{n}]: import gpulib_ctypes (module gpulib_ctypes)" in text


def test_a_driver_initialised_before_load_ext(fresh, runs_dir):
    k = fresh(before_load="import gpulib_ctypes")
    text = refused(k, runs_dir)
    assert "The CUDA driver (" in text and "libcuda.so.1) was initialised before %load_ext nbddp." in text
    assert "already initialised in this kernel" in text and "%load_ext nbddp before importing them" in text


def test_guard_names_a_library_that_asked_torch_for_cuda(fresh, runs_dir):
    k = fresh()
    # a CPU build of torch cannot initialise CUDA: stand in for "torch says it is initialised" once tried
    k.ok("import torch\ntype(guard)._torch_initialised = lambda self=None: guard.site is not None")
    k.ok("z = 3\nimport gpulib_torch\n")
    n = cell_number(k)
    text = refused(k, runs_dir)
    assert f"by In [{n}], line 2: import gpulib_torch (inside module gpulib_torch)" in text
    assert "move `import gpulib_torch` into the %%ddp cell" in text


def test_guard_names_the_cell_and_line_that_called_torch_cuda(fresh, runs_dir):
    k = fresh()
    k.ok("import torch\ntype(guard)._torch_initialised = lambda self=None: guard.site is not None")
    k.ok("x = 1\ny = 2\ntry:\n    torch.cuda._lazy_init()  # what .cuda() calls\n"
         "except (AssertionError, RuntimeError):\n    pass\n")
    n = cell_number(k)
    text = refused(k, runs_dir)
    assert f"In [{n}], line 4: torch.cuda._lazy_init()" in text
    assert "move every .cuda()/.to('cuda') into the %%ddp cell" in text and "drop --start-method fork" in text


def test_cpu_ranks_are_never_guarded(fresh):
    k = fresh()
    k.ok("import gpulib_ctypes")
    assert said(k.ok("%%ddp --devices 2 --accelerator cpu\nprint('fine')\n").stdout, 1, "fine")


def test_gpu_options_checked_against_what_nvml_sees(clean_kernel):
    k = clean_kernel
    k.ok(FAKE_NVML + "guard = nbddp.hw.cuda.backend()\nguard.built = lambda: True\n")
    res = k.run("%%ddp --devices 0,3\npass\n")
    assert res.error["ename"] == "UsageError"
    assert "GPU 3" in res.error_text and "cuda:1  Fake H100" in res.error_text
    k.ok("nbddp.hw.nvml.use(nbddp.hw.nvml.Nvml()); del guard.built")
    res = k.run("%%ddp --devices 2 --accelerator cuda\npass\n")
    assert "NVML sees no GPU" in res.error_text


def test_the_cell_says_which_busy_gpus_auto_skipped(clean_kernel, runs_dir):
    k = clean_kernel
    k.ok(FAKE_NVML + """
class BusyNvml(FakeNvml):
    def usage(self):
        return [nbddp.hw.nvml.GpuUse(0, 'Fake H100', 40 * 2**30, 80 * 2**30, ((999001, 40 * 2**30),)),
                nbddp.hw.nvml.GpuUse(1, 'Fake H100', 2**28, 80 * 2**30, ())]
nbddp.hw.nvml.use(BusyNvml())
guard = nbddp.hw.cuda.backend()
guard.built = lambda: True
guard.refusal = lambda: nbddp.CudaInitialisedError('stand-in guard: stop before forking')
""")
    before = set(runs_dir.iterdir())
    res = k.run("%%ddp --devices auto --start-method fork\nprint('must not run')\n")
    assert "--devices auto uses the free GPU cuda:1; skipped:\n  cuda:0  1 other compute process on it (pid 999001" \
        in res.stderr + res.stdout
    assert res.error["ename"] == "CudaInitialisedError" and set(runs_dir.iterdir()) == before
    k.ok("del guard.built, guard.refusal; nbddp.hw.nvml.use(nbddp.hw.nvml.Nvml())")


@pytest.mark.unit
def test_a_gpu_rank_leaves_after_synchronising_without_nccl_teardown(monkeypatch):
    """On an H100, destroy_process_group cost a one-shot NCCL cell ~0.5 s of its ~1.2 s; a rank whose queued
    work is finished leaves with os._exit and the driver frees the rest (as Lightning's ranks do)."""
    import torch.distributed as dist

    from nbddp.hw import cuda
    from nbddp.rank import worker

    calls = []

    class StandIn:
        def synchronize(self):
            calls.append("synchronize")

    monkeypatch.setattr(cuda, "_backend", StandIn())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    spec = worker.RankSpec(0, 1, "cuda", "nccl", 0, 1, "/nonexistent/store", 1)
    worker._leave_group(spec, told=True)
    assert calls == ["synchronize"]


@pytest.mark.unit
def test_torch_is_never_kept_out_of_the_forkserver():
    """torch's CUDA wheels map the driver as torch is imported: torch is seen loading it, yet its modules
    initialise no device. Kept out of the forkserver's imports, every forkserver rank imported
    torch._dynamo again (4 s a cell on an H200); the packages that did initialise CUDA stay out."""
    from nbddp.hw import cuda, driverwatch

    c = cuda.Cuda()
    c.watch.loaded = driverwatch.Sighting("In [1]", "torch.cuda", "import torch")
    c.watch.initialised = driverwatch.Sighting("In [2]", None, None, suspects=("pycuda", "torch"))
    c.site = cuda.InitSite("In [3]", 1, "model.cuda()", "transformers.modeling_utils")
    assert c.culprits() == {"pycuda", "transformers"}
