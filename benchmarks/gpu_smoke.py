"""The one command that proves nbddp on a GPU machine: python benchmarks/gpu_smoke.py

Needs a CUDA build of torch, nvidia-ml-py, ipykernel and jupyter_client (docs/gpu.md: installing them on a
machine without network). Adapts to the GPUs present; each check runs in a fresh real kernel:
  - CUDA guard, torch: a cell that calls .cuda() makes %%ddp refuse, naming that cell and line;
  - CUDA guard, another library: a module that calls cuInit through ctypes on import makes %%ddp refuse,
    naming the cell, the module and the fix;
  - NCCL, 1 rank: %%ddp --devices 1, all_reduce on the GPU;
  - gloo, 2 ranks sharing GPU 0: --accelerator cpu ranks that put their tensors on cuda:0;
  - NVML dashboard: the live widget shows a row per GPU with utilisation;
  - free-GPU picking: with another process holding memory on GPU 0, --devices auto skips it and says why;
  - a pool on the GPU: %ddp start --devices 1, cells that build and train a model, a failing cell, the model
    kept, %ddp stop leaving no rank behind;
  - stepping into a GPU rank: input(), breakpoint() and %pdb post-mortem answered from the notebook's input box;
  - progress bars: tqdm in a GPU rank draws one bar, at 100% in the end;
  - step time: the same DDP loop as a %%ddp cell and under torchrun, steps/s ratio;
  - with 2+ GPUs, also NCCL across all of them.
Prints a PASS/FAIL table; exits 1 on any FAIL. Without a GPU it says so in one line and exits 2.
--out DIR: also writes there, per check, the transcript of every cell it ran (smoke-<check>.txt), the live
dashboard's last HTML (dashboard.html) and the results (smoke.json).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_GPU_EXIT = 2

LOOP = """import time, torch, torch.distributed as dist
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).to(device), device_ids=[device.index])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(1024, 4096, device=device)  # GPU-bound, as training is (batch 256 is launch-bound: see results.md)
def step():
    opt.zero_grad(); model(x).square().mean().backward(); opt.step()
for _ in range(30):
    step()
torch.cuda.synchronize(); dist.barrier()
t0 = time.perf_counter()
for _ in range(STEPS):
    step()
torch.cuda.synchronize(); dist.barrier()
steps_per_s = STEPS / (time.perf_counter() - t0)
"""  # the DDP loop timed in a %%ddp cell and under torchrun, here and in benchmarks/bench_gpu.py; STEPS given first


def train_script(steps: int) -> str:
    """``LOOP`` as a torchrun script: rank 0 prints ``STEPS <steps/s>``."""
    return ("import os, torch, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
            "torch.cuda.set_device(local_rank)\ndevice = torch.device('cuda', local_rank)\n"
            f"dist.init_process_group('nccl')\nSTEPS = {steps}\n" + LOOP +
            "if dist.get_rank() == 0:\n    print('STEPS', steps_per_s)\ndist.destroy_process_group()\n")


# A CUDA user that is not torch: loads the driver and initialises it on import (like pycuda.autoinit).
CUDA_LIBRARY = "import ctypes\n_rc = ctypes.CDLL('libcuda.so.1').cuInit(0)\nassert _rc == 0, _rc\n"


def gpu_count() -> int:
    """GPUs NVML sees (never CUDA: this process forks nothing, but keeps to nbddp's rule anyway)."""
    sys.path.insert(0, str(ROOT))
    from nbddp.hw import nvml

    return nvml.backend().count()


def plan_checks(gpus: int) -> list[tuple[str, object]]:
    checks = [("CUDA guard: torch", check_guard_torch), ("CUDA guard: other library", check_guard_library),
              ("NCCL, 1 rank", check_nccl_one), ("gloo, 2 ranks on GPU 0", check_gloo_shared),
              ("NVML dashboard", lambda: check_dashboard(gpus)), ("free-GPU picking", lambda: check_free(gpus)),
              ("pool on the GPU", check_pool), ("debugging a GPU rank", check_debugging),
              ("progress bar on a GPU rank", check_bars)]
    if gpus >= 2:
        checks.append((f"NCCL across {gpus} GPUs", lambda: check_nccl_all(gpus)))
    checks.append(("step time vs torchrun", lambda: check_step_time(min(gpus, 2))))
    return checks


OUT: Path | None = None  # --out
TRANSCRIPT: list[str] = []  # every cell the current check ran, with what came back


def fresh_kernel(extra_path: str | None = None):
    from kernel import Kernel

    class Recorded(Kernel):
        def collect(self, msg_id, timeout=60, on_message=None, between=None):
            res = super().collect(msg_id, timeout, on_message, between)
            TRANSCRIPT.append(f"--- {res.seconds:.2f} s, status {res.status}\n[stdout]\n{res.stdout}\n[stderr]\n"
                              f"{res.stderr}\n[error]\n{res.error_text if res.error else ''}")
            return res

        def execute(self, code):
            TRANSCRIPT.append(f"=== cell\n{code}")
            return super().execute(code)

        def converse(self, code, answer, timeout=60):
            TRANSCRIPT.append(f"=== cell (answered from the input box)\n{code}")
            res = super().converse(code, answer, timeout)
            TRANSCRIPT.append(f"[prompts] {res.prompts}")
            return res

    env = {"NBDDP_RUNS_DIR": tempfile.mkdtemp()}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), extra_path) if p)
    k = Recorded(env=env)
    k.ok("%load_ext nbddp\nimport torch, nbddp")
    return k


def answers(*lines):
    """A front end that types ``lines`` in order into the input box."""
    left = list(lines)
    return lambda prompt: left.pop(0) if left else "c"


def check_guard_torch() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        k.ok("x = torch.zeros(1).cuda()  # initialises CUDA in the kernel")
        res = k.run("%%ddp\nprint('must not run')")
        text = res.error_text if res.error else ""
        ok = bool(res.error) and res.error["ename"] == "CudaInitialisedError" and "torch.zeros(1).cuda()" in text
        return ok, text.splitlines()[0] if text else "no error raised"
    finally:
        k.shutdown()


def check_guard_library() -> tuple[bool, str]:
    lib = tempfile.mkdtemp()
    Path(lib, "smoke_cudalib.py").write_text(CUDA_LIBRARY)
    k = fresh_kernel(lib)
    try:
        clean = k.value("nbddp.hw.cuda.backend().refusal() is None")  # nbddp loads no driver to find out
        k.ok("import smoke_cudalib")
        res = k.run("%%ddp\nprint('must not run')")
        text = res.error_text if res.error else ""
        ok = clean and "import smoke_cudalib (module smoke_cudalib)" in text and "into the %%ddp cell" in text
        return ok, text.splitlines()[0] if text else "no error raised"
    finally:
        k.shutdown()


def check_nccl_one() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        res = k.ok("%%ddp --devices 1\nimport torch.distributed as dist\nt = torch.ones(1, device=device)\n"
                   "dist.all_reduce(t)\nprint(dist.get_backend(), device, t.item())\n")
        ok = "[rank0]:nccl cuda:0 1.0" in res.stdout
        return ok, "1 nccl rank on cuda:0" if ok else res.stdout[-300:]
    finally:
        k.shutdown()


def check_gloo_shared() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        res = k.ok("%%ddp --devices 2 --accelerator cpu\nimport torch.distributed as dist\n"
                   "t = torch.ones(1, device='cuda:0') * (rank + 1)\ndist.all_reduce(t)\n"
                   "print(dist.get_backend(), t.device, t.item())\n")
        from kernel import said

        ok = all(said(res.stdout, r, "gloo cuda:0 3.0") for r in (0, 1))
        return ok, "2 gloo ranks sharing cuda:0, all_reduce sum 3 on each" if ok else res.stdout[-300:]
    finally:
        k.shutdown()


def check_nccl_all(n: int) -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        res = k.ok("%%ddp --devices -1\nimport torch.distributed as dist\nt = torch.ones(1, device=device) * (rank + 1)\n"
                   "dist.all_reduce(t)\nprint(dist.get_backend(), device, torch.cuda.current_device(), t.item())\n")
        want = n * (n + 1) / 2
        rows = re.findall(r"\[rank(\d+)\]:nccl cuda:(\d+) (\d+) ([\d.]+)", res.stdout)
        ok = len(rows) == n and all(r == d == c and float(v) == want for r, d, c, v in rows)
        return ok, f"{n} GPUs, {len(rows)} nccl ranks, all_reduce sum {want:g} on each"
    finally:
        k.shutdown()


def check_dashboard(gpus: int) -> tuple[bool, str]:
    n = min(gpus, 2)
    k = fresh_kernel()
    try:
        res = k.ok(f"%%ddp --devices {n}\nimport time\nx = torch.randn(8192, 8192, device=device)\n"
                   "t0 = time.time()\nwhile time.time() - t0 < 4:\n    x = x @ x / x.norm()\ntorch.cuda.synchronize()\n")
        # the live states: each rank's row shows its GPU's utilisation and memory (the last state, once the
        # ranks are gone, keeps only the peak)
        states = [d["data"] for d in res.displays if "nbddp-run" in d["data"].get("text/html", "")]
        TRANSCRIPT.append("[dashboard states]\n" + "\n--\n".join(d.get("text/plain", "") for d in states))
        live = [d for d in states if all(re.search(rf"^{r} .*\d+% · [\d.]+ [GM]B / [\d.]+ [GM]B", d.get("text/plain", ""),
                                                   re.MULTILINE) for r in range(n))]
        busy = [d for d in live if re.search(r"^0 .* ([1-9]\d*)% ·", d["text/plain"], re.MULTILINE)]
        if OUT and (busy or live):
            (OUT / "dashboard.html").write_text((busy or live)[-1]["text/html"])
            (OUT / "dashboard.txt").write_text((busy or live)[-1]["text/plain"])
        ok = bool(busy)
        row = next((ln for ln in busy[-1]["text/plain"].splitlines() if ln.startswith("0 ")), "") if busy else ""
        return ok, f"live row: {' '.join(row.split())[:120]}" if ok else f"no busy GPU row in {len(live)} live state(s)"
    finally:
        k.shutdown()


HOLDER = """import sys, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda:0')
print('holding', flush=True)
sys.stdin.read()
"""


def check_free(gpus: int) -> tuple[bool, str]:
    """Another process holds memory on GPU 0 (over the threshold, so even where NVML cannot show its pid)."""
    sys.path.insert(0, str(ROOT))
    from nbddp.hw import gpufree, nvml

    total = nvml.backend().usage()[0].mem_total or 16 * 2**30
    size = int(total * (gpufree.BUSY_MEMORY_FRACTION + 0.05))
    k = fresh_kernel()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "holding":
            return False, "the process meant to hold GPU 0 did not start"
        auto = k.run("p = nbddp.kernel.devices.plan('auto')\nprint(p.device_ids, p.notes)")
        named = k.ok("q = nbddp.kernel.devices.plan('0,')\nprint(q.notes)").stdout
        if gpus == 1:
            ok = bool(auto.error) and "found no free GPU" in auto.error_text and "cuda:0" in auto.error_text
        else:
            ok = auto.error is None and "(0," not in auto.stdout and "skipped:" in auto.stdout
        ok = ok and "cuda:0 is busy" in named
        detail = (auto.error_text if auto.error else auto.stdout).strip().splitlines()
        return ok, (detail[0] if detail else "") + " | named: " + ("warned" if "is busy" in named else "not warned")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
        k.shutdown()


def check_pool() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        k.ok("%ddp start --devices 1", timeout=180)
        first = k.ok("%%ddp\nimport torch.distributed as dist\nmodel = torch.nn.Linear(64, 64).to(device)\n"
                     "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nsteps = 0\n"
                     "print('built', dist.get_backend(), next(model.parameters()).device)\n")
        train = ("%%ddp\nfor _ in range(5):\n    opt.zero_grad()\n"
                 "    model(torch.randn(8, 64, device=device)).square().mean().backward()\n    opt.step()\n"
                 "    steps += 1\nprint('steps', steps)\n")
        k.ok(train)
        bad = k.run("%%ddp\nx = torch.ones(3, device=device)\nraise ValueError('a bad batch')\n")
        k.ok(train)
        kept = k.ok("%%ddp\nt = torch.ones(1, device=device)\ndist.all_reduce(t)\n"
                    "print('kept', steps, model.weight.device, t.item())\n")
        heavy = k.ok("%%ddp\nimport time\nx = torch.randn(8192, 8192, device=device)\nt0 = time.time()\n"
                     "while time.time() - t0 < 3:\n    x = x @ x / x.norm()\ntorch.cuda.synchronize()\n", timeout=120)
        views = [d["data"]["text/html"] for d in heavy.displays if "nbddp-pool" in d["data"].get("text/html", "")]
        shown = k.ok("%ddp status")  # the pool's live view, shown again
        text = "\n".join(d["data"].get("text/plain", "") for d in shown.displays) or shown.stdout
        gpu = next((ln for ln in text.splitlines() if ln.startswith("cuda:0")), "")
        history = bool(re.match(r"cuda:0\s.*[▂▃▄▅▆▇█].* [\d.]+ [GM]B–[\d.]+ [GM]B$", gpu))  # util, then memory
        if OUT:
            (OUT / "pool.txt").write_text(text)
            if views:
                (OUT / "pool.html").write_text(views[-1])
        ranks = [p.pid for p in k.process().children(recursive=True)]
        k.ok("%ddp stop", timeout=60)
        left = [p.pid for p in k.process().children(recursive=True)]
        ok = ("[rank0]:built nccl cuda:0" in first.stdout and bad.error is not None
              and "ValueError: a bad batch" in bad.error_text and "[rank0]:kept 10 cuda:0 1.0" in kept.stdout
              and history and ranks and not left)
        return ok, (f"cells on a live NCCL rank, a failing cell in between, model kept (10 steps on cuda:0); "
                    f"GPU history {'shown' if history else 'MISSING'}: {' '.join(gpu.split())[:80]}; "
                    f"{len(ranks)} process(es) while up, {len(left)} after %ddp stop")
    finally:
        k.shutdown()


def check_debugging() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        res = k.converse("%%ddp --devices 1\nt = torch.ones(2, device=device) * 3\nname = input('name? ')\n"
                         "breakpoint()\nprint('got', name, t.sum().item())\n", answers("gpu", "p t.device", "c"),
                         timeout=120)
        stepped = (res.error is None and res.prompts[:1] == ["[rank0] name? "] and len(res.prompts) == 3
                   and "[rank0]:got gpu 6.0" in res.stdout and "device(type='cuda', index=0)" in res.stdout)
        k.ok("%pdb on")
        pm = k.converse("%%ddp --devices 1\ndef f():\n    g = torch.full((1,), 7.0, device=device)\n"
                        "    return {}[1]\nf()\n", answers("p g.device, g.item()", "c"), timeout=120)
        post = ("KeyError: 1" in pm.error_text and "(device(type='cuda', index=0), 7.0)" in pm.stdout
                and "post-mortem" in pm.stderr)
        return stepped and post, (f"input + breakpoint on cuda:0: {'ok' if stepped else 'FAILED'}; "
                                  f"%pdb post-mortem in the failed GPU rank: {'ok' if post else 'FAILED'}")
    finally:
        k.shutdown()


def check_bars() -> tuple[bool, str]:
    k = fresh_kernel()
    try:
        res = k.ok("%%ddp --devices 1\nfrom tqdm.auto import tqdm\nx = torch.randn(1024, 1024, device=device)\n"
                   "for i in tqdm(range(50), mininterval=0, desc='gpu'):\n    x = x @ x / x.norm()\n"
                   "torch.cuda.synchronize()\n", timeout=120)
        bars = list(res.bar_states.values())
        ok = (len(bars) == 1 and bars[0]["text/plain"].startswith("[rank0]:gpu: 100%") and "50/50" in bars[0]["text/plain"]
              and "nbddp-bar" in bars[0]["text/html"] and "%|" not in res.stderr)
        return ok, bars[0]["text/plain"] if bars else "no bar drawn"
    finally:
        k.shutdown()


def check_step_time(n: int, rounds: int = 2) -> tuple[bool, str]:
    """The same loop in a %%ddp cell and under torchrun, interleaved, best of ``rounds`` each (a GPU's clocks
    and a shared machine drift: a single short run each once read 0.90 where longer interleaved ones read 1.00)."""
    steps = 300
    script = Path(tempfile.mkdtemp()) / "train.py"
    script.write_text(train_script(steps))
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    ours, theirs = [], []
    k = fresh_kernel()
    try:
        for _ in range(rounds):
            ours.append(float(k.ok(f"%%ddp --devices {n} --ranks-output none\nSTEPS = {steps}\n" + LOOP + "steps_per_s",
                                   timeout=600).result))
            out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(n), str(script)],
                                 capture_output=True, text=True, timeout=600, check=False)
            TRANSCRIPT.append(f"=== torchrun, exit {out.returncode}\n{out.stdout}\n{out.stderr}")
            if "STEPS" not in out.stdout:
                return False, f"torchrun failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}"
            theirs.append(float(out.stdout.split("STEPS")[1].split()[0]))
    finally:
        k.shutdown()
    ratio = max(ours) / max(theirs)
    return ratio >= 0.98, (f"{n} rank(s), best of {rounds}: %%ddp {max(ours):.1f} steps/s, torchrun {max(theirs):.1f} "
                           f"steps/s, ratio {ratio:.3f}")


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write transcripts, the dashboard's HTML and smoke.json here")
    OUT = ap.parse_args().out
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
    gpus = gpu_count()
    if gpus == 0:
        print("gpu_smoke: no GPU here (NVML sees none: no NVIDIA GPU, no driver, or nvidia-ml-py not installed); "
              "nothing checked.", file=sys.stderr)
        return NO_GPU_EXIT
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        import kernel  # noqa: F401  (jupyter_client, ipykernel)
    except ImportError as e:
        print(f"gpu_smoke: {e.name} is not installed; docs/gpu.md says which wheels to carry.", file=sys.stderr)
        return NO_GPU_EXIT
    import time
    import traceback

    from nbddp.hw import nvml

    failed, results = 0, []
    print(f"{gpus} GPU(s): {', '.join(nvml.backend().names())}")
    print(f"{'check':28} result  detail")
    for name, fn in plan_checks(gpus):
        TRANSCRIPT.clear()
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - report every check
            ok, detail = False, f"{type(e).__name__}: {e}"
            TRANSCRIPT.append(traceback.format_exc())
        failed += not ok
        results.append({"check": name, "ok": ok, "detail": detail, "seconds": time.perf_counter() - t0})
        print(f"{name:28} {'PASS' if ok else 'FAIL'}    {detail}", flush=True)
        if OUT:
            (OUT / f"smoke-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.txt").write_text("\n".join(TRANSCRIPT))
    if OUT:
        (OUT / "smoke.json").write_text(json.dumps({"gpus": nvml.backend().names(), "checks": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
