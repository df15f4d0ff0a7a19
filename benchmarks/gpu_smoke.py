"""The one command that proves nbddp on a multi-GPU machine: python benchmarks/gpu_smoke.py

Needs a CUDA build of torch, nvidia-ml-py (pip install 'nbddp[gpu]') and at least 2 GPUs. Checks, each
in a fresh real kernel:
  1. the CUDA guard: a cell that calls .cuda() makes %%ddp refuse, naming that cell and line;
  2. NCCL ranks: one rank per GPU, backend nccl, each on its own device, all_reduce on the GPU;
  3. the NVML dashboard: the live widget shows a row per GPU with utilisation and memory;
  4. step time: the same DDP loop as a %%ddp cell and under torchrun, steps/s ratio.
Prints a PASS/FAIL table; exits non-zero on any FAIL.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from kernel import Kernel  # noqa: E402

LOOP = """import time, torch, torch.distributed as dist
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).to(device), device_ids=[device.index])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 4096, device=device)
def step():
    opt.zero_grad(); model(x).square().mean().backward(); opt.step()
for _ in range(20):
    step()
torch.cuda.synchronize(); dist.barrier()
t0 = time.perf_counter()
for _ in range(200):
    step()
torch.cuda.synchronize(); dist.barrier()
steps_per_s = 200 / (time.perf_counter() - t0)
"""


def fresh_kernel() -> Kernel:
    k = Kernel(env={"NBDDP_RUNS_DIR": tempfile.mkdtemp()})
    k.ok("%load_ext nbddp\nimport torch, nbddp")
    return k


def check_guard() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        k.ok("x = torch.zeros(1).cuda()  # initialises CUDA in the kernel")
        res = k.run("%%ddp\nprint('must not run')")
        ok = bool(res.error) and res.error["ename"] == "CudaInitialisedError" and "torch.zeros(1).cuda()" in res.error_text
        return ok, res.error_text.splitlines()[0] if res.error else "no error raised"
    finally:
        k.shutdown()


def check_nccl() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        n = k.value("len(nbddp.environment().gpus)")
        res = k.ok("%%ddp --devices -1\nimport torch.distributed as dist\nt = torch.ones(1, device=device) * (rank + 1)\n"
                   "dist.all_reduce(t)\nprint(dist.get_backend(), device, torch.cuda.current_device(), t.item())\n")
        want = n * (n + 1) / 2
        rows = re.findall(r"\[rank(\d+)\]:nccl cuda:(\d+) (\d+) ([\d.]+)", res.stdout)
        ok = n >= 2 and len(rows) == n and all(r == d == c and float(v) == want for r, d, c, v in rows)
        return ok, f"{n} GPUs, {len(rows)} nccl ranks, all_reduce sum {want:g} on each"
    finally:
        k.shutdown()


def check_dashboard() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        res = k.ok("%%ddp --devices 2\nimport time\nx = torch.randn(8192, 8192, device=device)\n"
                   "t0 = time.time()\nwhile time.time() - t0 < 4:\n    x = x @ x / x.norm()\ntorch.cuda.synchronize()\n")
        states = [c["data"].get("state", {}).get("value", "") for c in res.comms]
        live = [s for s in states if "util history" in s]
        ok = bool(live) and "cuda:0" in live[-1] and "cuda:1" in live[-1] and re.search(r"\d+%", live[-1]) is not None
        return ok, "GPU rows with utilisation in the live widget" if ok else "no GPU rows seen"
    finally:
        k.shutdown()


def check_step_time() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        ours = float(k.ok("%%ddp --devices 2 --ranks-output none\n" + LOOP + "steps_per_s", timeout=600).result)
    finally:
        k.shutdown()
    script = Path(tempfile.mkdtemp()) / "train.py"
    script.write_text("import os, torch, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
                      "torch.cuda.set_device(local_rank)\ndevice = torch.device('cuda', local_rank)\n"
                      "dist.init_process_group('nccl')\n" + LOOP +
                      "if dist.get_rank() == 0:\n    print('STEPS', steps_per_s)\ndist.destroy_process_group()\n")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)], capture_output=True,
                         text=True, timeout=600)
    theirs = float(out.stdout.split("STEPS")[1].split()[0])
    ratio = ours / theirs
    return ratio >= 0.98, f"%%ddp {ours:.1f} steps/s, torchrun {theirs:.1f} steps/s, ratio {ratio:.3f}"


def main() -> int:
    checks = [("CUDA guard", check_guard), ("NCCL ranks", check_nccl), ("NVML dashboard", check_dashboard),
              ("step time vs torchrun", check_step_time)]
    failed = 0
    print(f"{'check':24} result  detail")
    for name, fn in checks:
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - report every check
            ok, detail = False, f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{name:24} {'PASS' if ok else 'FAIL'}    {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
