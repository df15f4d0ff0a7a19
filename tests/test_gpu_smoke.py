"""benchmarks/gpu_smoke.py fits the machine: which checks it plans for 1 or more GPUs, and on a machine
without a GPU (this one) one line and a non-zero exit instead of a traceback."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "benchmarks" / "gpu_smoke.py"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SMOKE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.unit
def test_one_gpu_plan(smoke):
    names = [n for n, _ in smoke.plan_checks(1)]
    assert names == ["CUDA guard: torch", "CUDA guard: other library", "NCCL, 1 rank", "gloo, 2 ranks on GPU 0",
                     "NVML dashboard", "free-GPU picking", "pool on the GPU", "debugging a GPU rank",
                     "progress bar on a GPU rank", "step time vs torchrun"]


@pytest.mark.unit
def test_more_gpus_add_nccl_across_them(smoke):
    names = [n for n, _ in smoke.plan_checks(4)]
    assert "NCCL across 4 GPUs" in names and names[-1] == "step time vs torchrun"
    assert len(names) == len(smoke.plan_checks(1)) + 1


@pytest.mark.timeout(120)
def test_no_gpu_says_so_in_one_line_and_exits_non_zero():
    out = subprocess.run([sys.executable, str(SMOKE)], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_smoke: no GPU here (NVML sees none"), out.stderr
