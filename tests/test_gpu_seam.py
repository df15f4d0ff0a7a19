"""The CUDA guard, in a real kernel, with only NVML and the driver probe replaced at their seams."""
import pytest

pytestmark = pytest.mark.timeout(120)

STAND_INS = """
import nbddp.cuda, nbddp.nvml
class FakeNvml:
    def count(self): return 2
    def names(self): return ['Fake H100', 'Fake H100']
    def sample(self, indices): return []
class StandInCuda(nbddp.cuda.Cuda):
    poisoned = False
    def built(self): return True
    def _forked_child_can_init(self): return not self.poisoned
nbddp.nvml.use(FakeNvml())
stand_in = StandInCuda()
nbddp.cuda.use(stand_in)
stand_in.install(get_ipython())
"""


def test_guard_names_the_cell_and_line_that_initialised_cuda(clean_kernel, runs_dir):
    k = clean_kernel
    k.ok(STAND_INS)
    assert k.ok("import os; os.environ['PYTORCH_NVML_BASED_CUDA_CHECK']").result == "'1'"
    n = k.ok("x = 1\ntry:\n    torch.cuda._lazy_init()  # what .cuda() calls\nexcept (AssertionError, RuntimeError):\n    pass\n")
    assert n.error is None
    count = k.value("get_ipython().execution_count - 1")
    stand_in_poisoned = "stand_in.poisoned = True"
    k.ok(stand_in_poisoned)
    before = set(runs_dir.iterdir())
    res = k.run("%%ddp --devices 2\nprint('must not run')\n")
    assert res.error["ename"] == "CudaInitialisedError", res.error_text
    text = res.error_text
    assert f"In [{count - 1}], line 3: torch.cuda._lazy_init()" in text
    assert "restart the kernel" in text and "--start-method spawn" in text
    assert "must not run" not in res.stdout
    assert set(runs_dir.iterdir()) == before  # nothing was launched


def test_guard_catches_cuda_initialised_behind_torchs_back(clean_kernel):
    k = clean_kernel
    k.ok(STAND_INS + "stand_in.poisoned = True  # a library called cuInit itself")
    res = k.run("%%ddp --devices 2\nprint('must not run')\n")
    assert res.error["ename"] == "CudaInitialisedError"
    assert "already initialised in this kernel" in res.error_text


def test_cpu_ranks_are_never_guarded(clean_kernel):
    k = clean_kernel
    k.ok(STAND_INS + "stand_in.poisoned = True")
    assert "[rank1]:fine" in k.ok("%%ddp --devices 2 --accelerator cpu\nprint('fine')\n").stdout


def test_gpu_options_checked_against_what_nvml_sees(clean_kernel):
    k = clean_kernel
    k.ok(STAND_INS)
    res = k.run("%%ddp --devices 0,3\npass\n")
    assert res.error["ename"] == "UsageError"
    assert "GPU 3" in res.error_text and "cuda:1  Fake H100" in res.error_text
    k.ok("nbddp.nvml.use(nbddp.nvml.Nvml()); nbddp.cuda.use(nbddp.cuda.Cuda())")
    res = k.run("%%ddp --devices 2 --accelerator cuda\npass\n")
    assert "NVML sees no GPU" in res.error_text
