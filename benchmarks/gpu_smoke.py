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
        res = k.run("%%ddp --start-method fork\nprint('must not run')")  # (by default: the forkserver)
        text = res.error_text if res.error else res.stderr  # (a UsageError may be printed, not sent as an error)
        ok = "must not run" not in res.stdout and "torch.zeros(1).cuda()" in text
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
        res = k.run("%%ddp --start-method fork\nprint('must not run')")
        text = res.error_text if res.error else res.stderr
        ok = clean and "must not run" not in res.stdout and "import smoke_cudalib (module smoke_cudalib)" in text
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
        live = [d for d in states if all(re.search(rf"^{r} .*\d+% · [\d.]+ [GMK]i?B / [\d.]+ [GMK]i?B", d.get("text/plain", ""),
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
        template = {p.pid for p in k.process().children(recursive=True)}  # the forkserver's: the kernel's own
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
        history = bool(re.match(r"cuda:0\s.*[▂▃▄▅▆▇█].* [\d.]+ [GMK]i?B–[\d.]+ [GMK]i?B$", gpu))  # util, then memory
        if OUT:
            (OUT / "pool.txt").write_text(text)
            if views:
                (OUT / "pool.html").write_text(views[-1])
        ranks = [p.pid for p in k.process().children(recursive=True) if p.pid not in template]
        k.ok("%ddp stop", timeout=60)
        left = [p.pid for p in k.process().children(recursive=True) if p.pid not in template]
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


# -- round 5 (issue 57): a kernel that holds CUDA, --profile on NCCL, a lost GPU rank, NCCL's group made anew ----
DEV = os.environ.get("NBDDP_SMOKE_DEVICE", "cuda:0")  # "cpu": a rehearsal of the checks' logic without a GPU
FIGURES: dict = {}  # round 5's measured figures, into smoke.json


def _gpu_mib(pids) -> dict:
    """GPU memory NVML shows for each of ``pids`` (MiB), none where it shows none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        used = pynvml.nvmlDeviceGetMemoryInfo(h).used
    except Exception:  # noqa: BLE001 - the rehearsal on CPU
        return {"device": 0}
    found = {p.pid: (p.usedGpuMemory or 0) / 2**20 for p in procs if p.pid in set(pids)}
    found["device"] = used / 2**20
    return found


def _uss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_full_info().uss / 2**20


def _first_cell(k, cell: str) -> tuple[float, object]:
    import time

    t0 = time.perf_counter()
    res = k.ok(cell, timeout=240)
    return time.perf_counter() - t0, res


def check_forkserver_cuda() -> tuple[bool, str]:
    """Item 1: a kernel that ran ``.cuda()``, then %%ddp --devices 1 and a pool, against a clean kernel's fork."""
    from helpers import pool_pids

    mib = 64
    make = f"w = torch.randn({mib} * 2**18, device='{DEV}')\nwsum = int(w.view(torch.int32).sum())  # exact\n"
    read = ("%%ddp --devices 1\nimport os, psutil\nv = w if w.device.type == device.type else w.to(device)\n"
            "print('w', v.device, int(v.view(torch.int32).sum()) == wsum, psutil.Process().memory_full_info().uss >> 20)\n"
            "m = model.to(device)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\nm(torch.ones(2, 1024, device=device)).sum()"
            ".backward()\nopt.step()\nprint('trained', type(m.weight).__name__, m.weight.is_leaf, m.weight.device)\n")
    if DEV != "cpu":  # the machine's first CUDA process pays the driver's start: not the first kernel's cell
        subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1).cuda()"], check=True, timeout=120)
    out = {}
    for held in (True, False):
        k = fresh_kernel()
        try:
            if held:
                k.ok(f"model = torch.nn.Linear(1024, 1024).to('{DEV}')  # the kernel holds CUDA\n" + make)
            else:
                k.ok("model = torch.nn.Linear(1024, 1024)\n" + make.replace(f"device='{DEV}'", "device='cpu'"))
            seconds, res = _first_cell(k, read)
            again, _ = _first_cell(k, read)
            t_start, started = _first_cell(k, "%ddp start --devices 1")
            pids = pool_pids(k)
            t_cell, pooled = _first_cell(k, read)
            out[held] = dict(one_shot_s=seconds, one_shot_again_s=again, start_s=t_start, pool_cell_s=t_cell,
                             rank_uss_mib=_uss_mib(pids[0]), rank_gpu_mib=_gpu_mib(pids).get(pids[0]),
                             said=[ln for ln in (res.stderr + res.stdout).splitlines() if "forkserver" in ln][:1],
                             ok="True" in res.stdout and "True" in pooled.stdout and f"w {DEV}" in res.stdout
                             and "trained Parameter True" in res.stdout and "trained Parameter True" in pooled.stdout,
                             nvml_warning="Can't initialize NVML" in res.stdout + res.stderr)
            k.ok("%ddp stop", timeout=60)
        finally:
            k.shutdown()
    FIGURES["forkserver"] = {"kernel holds CUDA": out[True], "clean kernel (fork)": out[False]}
    h, c = out[True], out[False]
    ok = h["ok"] and c["ok"] and bool(h["said"]) and not c["said"] and not h["nvml_warning"]
    return ok, (f"one-shot {h['one_shot_s']:.2f} s (again {h['one_shot_again_s']:.2f}) vs fork {c['one_shot_s']:.2f} "
                f"({c['one_shot_again_s']:.2f}); pool start {h['start_s']:.2f} vs {c['start_s']:.2f} s; rank USS "
                f"{h['rank_uss_mib']:.0f} vs {c['rank_uss_mib']:.0f} MiB; said: {(h['said'] or ['nothing'])[0][:90]}")


PROFILED = """import torch
from torch.nn.parallel import DistributedDataParallel as DDP
dev = torch.device('DEV')
model = DDP(torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).to(dev),
            device_ids=IDS)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 2048, device=dev)
for _ in range(13):
    if rank == world_size - 1 and world_size > 1:
        time.sleep(0.03)  # the straggler
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
torch.cuda.synchronize() if dev.type == 'cuda' else None
"""


def check_profile_nccl() -> tuple[bool, str]:
    """Item 2: --profile of DDP on the GPU: 1 NCCL rank (NCCL's kernels as communication), and a straggler
    among 2 ranks sharing the GPU over gloo (one GPU cannot hold 2 NCCL ranks)."""
    import ast

    k = fresh_kernel()
    found = {}
    try:
        for label, head, ids in (("nccl", "%%ddp --devices 1 --profile 10", "[device.index]"),
                                 ("gloo", "%%ddp --devices 2 --accelerator cpu --profile 10", "None")):
            dev = DEV if label == "gloo" or DEV == "cpu" else "cuda:0"
            res = k.ok(head + "\nimport time\n" + PROFILED.replace("DEV", dev).replace(
                "IDS", ids if DEV != "cpu" else "None"), timeout=240)
            shown = next((d["data"]["text/plain"] for d in res.displays if "data" in d
                          and d["data"].get("text/plain", "").startswith("nbddp profile")), "")
            html = next((d["data"]["text/html"] for d in res.displays if "data" in d
                         and "<svg" in d["data"].get("text/html", "")), "")
            rows = json.loads(ast.literal_eval(k.ok("nbddp.profile().to_json(orient='records')").result))
            traces = re.findall(r"^trace: (.+)$", shown, re.M)
            kernels = set()
            for path in traces[:1]:
                with open(path) as f:
                    events = json.load(f).get("traceEvents", [])
                kernels = {e["name"] for e in events if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()}
            found[label] = dict(text=shown, rows=rows, nccl_kernels=sorted(kernels)[:6], traces=traces)
            if OUT:
                (OUT / f"profile-{label}.txt").write_text(shown)
                if html:
                    (OUT / f"profile-{label}.html").write_text(html)
    finally:
        k.shutdown()
    FIGURES["profile"] = found
    nccl, gloo = found["nccl"], found["gloo"]
    comm = nccl["rows"][0]["comm_s"] if nccl["rows"] else 0
    straggler = "rank 1 is the straggler" in gloo["text"]
    ok = bool(nccl["text"]) and straggler  # (NCCL launches no kernel of its own for one rank: said, not asked)
    return ok, (f"1 NCCL rank: comm {comm * 1e3:.1f} ms over 10 steps, NCCL kernels in the trace: "
                f"{', '.join(nccl['nccl_kernels'][:2]) or 'none'}; 2 gloo ranks on the GPU: straggler "
                f"{'named' if straggler else 'NOT named'}")


POOL_EXPR = "get_ipython().magics_manager.registry['DDPMagics'].pool"
STATE = """import torch
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024).to('DEV')
opt = torch.optim.SGD(model.parameters(), lr=0.1)
big = torch.randn(MIB * 2**18, device='DEV')
mine = rank
"""


def _wait(k, expr: str, within: float) -> float | None:
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if k.value(expr):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _said(k, killed_at: float) -> float | None:
    """Seconds from the kill to the loss recorded (the pool's own clock: polling waits while the loop heals)."""
    if _wait(k, f"bool({POOL_EXPR}.losses.history)", 10) is None:
        return None
    return k.value(f"{POOL_EXPR}.losses.history[-1].at") - killed_at


def check_lost_gpu_rank() -> tuple[bool, str]:
    """Item 3: a rank on the GPU killed with SIGKILL in a pool: what the pool does, how long, GPU memory freed.
    (a) 1 NCCL rank (no survivor to heal from); (b) 3 gloo ranks sharing the GPU, 512 MiB of GPU state each
    (a replacement heals from a peer)."""
    import signal
    import time

    from helpers import pool_pids

    figures = {}
    k = fresh_kernel()
    try:  # (a) the only rank, on NCCL
        k.ok(f"%ddp start --devices 1{' --accelerator cpu' if DEV == 'cpu' else ''}", timeout=180)
        k.ok("%%ddp\n" + STATE.replace("DEV", DEV).replace("MIB", "1024"), timeout=120)
        pid = pool_pids(k)[0]
        before = _gpu_mib([pid])
        killed, killed_at = time.monotonic(), time.time()
        os.kill(pid, signal.SIGKILL)
        said = _said(k, killed_at)
        freed = None
        while time.monotonic() - killed < 15:
            if pid not in _gpu_mib([pid]):
                freed = time.monotonic() - killed
                break
            time.sleep(0.05)
        _wait(k, f"not {POOL_EXPR}.losses.pending or not {POOL_EXPR}.gang.alive", 20)
        status = k.ok("%ddp status")
        text = "\n".join(d["data"].get("text/plain", "") for d in status.displays) or status.stdout
        figures["nccl_one_rank"] = dict(said_s=said, gpu_freed_s=freed, rank_gpu_mib=before.get(pid),
                                        device_mib_before=before.get("device"),
                                        device_mib_after=_gpu_mib([]).get("device"), status=text[-600:])
        k.ok("%ddp stop", timeout=60)
    finally:
        k.shutdown()
    k = fresh_kernel()
    try:  # (b) 3 gloo ranks sharing the GPU: a peer vouches, the replacement heals
        k.ok("%ddp start --devices 3 --accelerator cpu", timeout=180)
        k.ok("%%ddp\n" + STATE.replace("DEV", DEV).replace("MIB", "512"), timeout=120)
        pids = pool_pids(k)
        before = _gpu_mib(pids)
        killed, killed_at = time.monotonic(), time.time()
        os.kill(pids[2], signal.SIGKILL)
        said = _said(k, killed_at)
        healed = _wait(k, f"bool({POOL_EXPR}.losses.history) and not {POOL_EXPR}.losses.pending", 60)
        healed_s = time.monotonic() - killed if healed is not None else None
        res = k.ok("%%ddp --gather got\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                   "ddp = DDP(model)\nopt.zero_grad(); ddp(torch.ones(8, 1024, device=big.device)).sum().backward(); "
                   "opt.step()\ngot = (str(big.device), float(big.sum()), float(model.weight.sum()), 'mine' in globals())\n",
                   timeout=120)
        next_cell_s = time.monotonic() - killed
        got = k.value("got")
        new = pool_pids(k)
        after = _gpu_mib(new)
        status = k.ok("%ddp status")
        text = "\n".join(d["data"].get("text/plain", "") for d in status.displays) or status.stdout
        figures["gloo_three_ranks"] = dict(said_s=said, healed_s=healed_s, next_cell_s=next_cell_s,
                                           gpu_mib_before={str(p): before.get(p) for p in pids},
                                           gpu_mib_after={str(p): after.get(p) for p in new},
                                           replacement_uss_mib=_uss_mib(new[2]), got=got, said=res.stderr[-800:],
                                           status=text[-800:])
        k.ok("%ddp stop", timeout=60)
    finally:
        k.shutdown()
    FIGURES["lost"] = figures
    a, b = figures["nccl_one_rank"], figures["gloo_three_ranks"]
    same = len({tuple(g[:3]) for g in b["got"]}) == 1 and [g[3] for g in b["got"]] == [True, True, False]
    ok = (a["said_s"] is not None and b["healed_s"] is not None and same and str(DEV) in b["got"][2][0]
          and (DEV == "cpu" or a["gpu_freed_s"] is not None))
    fmt = lambda v: "never" if v is None else f"{v:.2f} s"  # noqa: E731
    return ok, (f"1 NCCL rank: said {fmt(a['said_s'])}, GPU memory freed {fmt(a['gpu_freed_s'])}; 3 gloo ranks on "
                f"the GPU: said {fmt(b['said_s'])}, healed {fmt(b['healed_s'])}, next cell {fmt(b['next_cell_s'])}, "
                f"replica equal: {same}")


REGROUP = """import time, torch, torch.distributed as dist, threading
from torch.nn.parallel import DistributedDataParallel as DDP
from nbddp.rank import ncclabort, usergroup
model = DDP(torch.nn.Linear(1024, 1024).to(device), device_ids=IDS)
model(torch.ones(4, 1024, device=device)).sum().backward()
torch.cuda.synchronize() if device.type == 'cuda' else None
free0 = torch.cuda.mem_get_info()[0] if device.type == 'cuda' else 0
watcher = any(t.name == 'nbddp-nccl-abort' for t in threading.enumerate())
times, frees = [], []
for g in range(1, 6):
    t0 = time.perf_counter()
    ncclabort.abort_groups()  # what the interrupt's watcher does to a rank stuck in a collective
    time.sleep(0.3)  # the watchdog's turn: a torn-down process would end here
    usergroup.regroup(1000 + g)  # what the kernel's Regroup does next
    t = torch.ones(1, device=device); dist.all_reduce(t)
    model = DDP(model.module, device_ids=IDS)
    model(torch.ones(4, 1024, device=device)).sum().backward()
    torch.cuda.synchronize() if device.type == 'cuda' else None
    times.append(time.perf_counter() - t0 - 0.3)
    frees.append(torch.cuda.mem_get_info()[0] if device.type == 'cuda' else 0)
regrouped = (watcher, dist.get_backend(), t.item(), [round(x, 3) for x in times], [(free0 - f) >> 20 for f in frees])
"""


def check_nccl_regroup() -> tuple[bool, str]:
    """Issue 55 on NCCL, as far as one GPU goes (two NCCL ranks cannot share it): a pool's rank aborts its
    communicators (ncclabort, the path that frees a rank stuck in a collective) and joins a new group at the
    next generation (usergroup.regroup), five times; DDP on each; the process lives, GPU memory does not grow."""
    k = fresh_kernel()
    try:
        k.ok(f"%ddp start --devices 1{' --accelerator cpu' if DEV == 'cpu' else ''}", timeout=180)
        k.ok("%%ddp --gather regrouped\n" + REGROUP.replace("IDS", "[device.index]" if DEV != "cpu" else "None"),
             timeout=180)
        got = k.value("regrouped")[0]
        alive = k.ok("%%ddp\nt = torch.ones(1, device=device); dist.all_reduce(t); print('alive', t.item())")
        k.ok("%ddp stop", timeout=60)
    finally:
        k.shutdown()
    watcher, backend, total, times, grown = got
    FIGURES["nccl_regroup"] = dict(watcher=watcher, backend=backend, seconds=times, gpu_mib_grown=grown)
    ok = ((watcher or DEV == "cpu") and total == 1.0 and "alive 1.0" in alive.stdout
          and (DEV == "cpu" or max(grown) - grown[0] < 64))
    return ok, (f"{backend}: aborted and made anew 5 times, {min(times) * 1e3:.0f}–{max(times) * 1e3:.0f} ms each; "
                f"GPU memory over the first: {grown} MiB; abort watcher {'on' if watcher else 'OFF'}")


ROUND5 = [("kernel holds CUDA: forkserver", check_forkserver_cuda), ("--profile on the GPU", check_profile_nccl),
          ("a lost GPU rank", check_lost_gpu_rank), ("NCCL group made anew", check_nccl_regroup)]


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


SAVED_ROUND5 = ROOT / "benchmarks" / "results_gpu_round5.json"  # the run's smoke.json, with the card and the run before
BEGIN, END = "<!-- gpu-round5:begin -->", "<!-- gpu-round5:end -->"


def render_round5(results_md: Path = ROOT / "benchmarks" / "results.md") -> None:
    """Round 5's figures (``SAVED_ROUND5``) into results.md, between their markers (at the end the first time)."""
    saved = json.loads(SAVED_ROUND5.read_text())
    r, before = saved["run"]["round5"], saved["before_fixes"]
    fs, lost, prof, rg = r["forkserver"], r["lost"], r["profile"], r["nccl_regroup"]
    held, clean = fs["kernel holds CUDA"], fs["clean kernel (fork)"]
    one, three = lost["nccl_one_rank"], lost["gloo_three_ranks"]
    b1 = before["forkserver"]
    rows = [BEGIN, "", "## GPU round 5 (issue 57)", "",
            f"Run {saved['date']} on {saved['card']}, torch {saved['torch']}, NCCL {saved['nccl']}: "
            "`python benchmarks/gpu_smoke.py --out DIR` (docs/gpu.md), each check in fresh real kernels, one run; "
            "run.py puts this section back from `results_gpu_round5.json`.", "",
            "### A kernel that holds CUDA: the forkserver, beside a fork of a clean kernel", "",
            "The cell reads the notebook's 64 MiB GPU tensor (by CUDA IPC from the kernel that holds CUDA; moved to "
            "the GPU by the cell in the clean one) and the notebook's `Linear(1024, 1024)`, and trains one step.", "",
            "| | kernel holds CUDA (forkserver) | clean kernel (fork) |", "|---|---|---|",
            f"| first one-shot cell | {held['one_shot_s']:.2f} s | {clean['one_shot_s']:.2f} s |",
            f"| the same cell again | {held['one_shot_again_s']:.2f} s | {clean['one_shot_again_s']:.2f} s |",
            f"| `%ddp start --devices 1` | {held['start_s']:.2f} s | {clean['start_s']:.2f} s |",
            f"| the pool's first cell | {held['pool_cell_s']:.2f} s | {clean['pool_cell_s']:.2f} s |",
            f"| the rank's private memory (USS) | {held['rank_uss_mib']:.0f} MiB | {clean['rank_uss_mib']:.0f} MiB |",
            f"| the rank's GPU memory (NVML) | {held['rank_gpu_mib']:.0f} MiB | {clean['rank_gpu_mib']:.0f} MiB |", "",
            f"The run before, whose cell only read the tensor: forkserver {b1['kernel holds CUDA']['one_shot_s']:.2f} s "
            f"(again {b1['kernel holds CUDA']['one_shot_again_s']:.2f} s), fork {b1['clean kernel (fork)']['one_shot_s']:.2f}"
            f" s (again {b1['clean kernel (fork)']['one_shot_again_s']:.2f} s). The ~4 s a forkserver cell pays for one "
            "training step is `torch._dynamo` imported again in every forkserver rank (torch was kept out of the "
            "forkserver's imports as a package seen loading the driver); fixed since (`Cuda.culprits`), not measured "
            "on a GPU again.", "",
            "### A lost GPU rank (SIGKILL)", "",
            "| | said | healed | next cell done | GPU memory back |", "|---|---|---|---|---|",
            f"| 1 NCCL rank, 1 GiB on the GPU (the pool ends: no survivor) | {one['said_s']:.2f} s | — | — | "
            f"{one['gpu_freed_s']:.2f} s ({one['rank_gpu_mib']:.0f} MiB) |",
            f"| 3 gloo ranks sharing the GPU, 512 MiB of GPU state each: by CUDA IPC | {three['said_s']:.2f} s | "
            f"{three['healed_s']:.2f} s | {three['next_cell_s']:.2f} s | — |",
            f"| the same, the run before: GPU tensors by value through the host | "
            f"{before['lost']['gloo_three_ranks']['said_s']:.2f} s | {before['lost']['gloo_three_ranks']['healed_s']:.2f} s"
            f" | {before['lost']['gloo_three_ranks']['next_cell_s']:.2f} s | — |", "",
            f"The replacement's private memory right after healing: {three['replacement_uss_mib']:.0f} MiB (its CUDA "
            "context's host side; the survivors' alike).", "",
            "### NCCL's group made anew in a rank (issue 55 on NCCL, as far as one GPU goes)", "",
            f"`ncclabort.abort_groups` then `usergroup.regroup`, then an all_reduce and a DDP step, five times: "
            f"{', '.join(f'{x:.2f}' for x in rg['seconds'])} s; GPU memory over the first: "
            f"{', '.join(str(x) for x in rg['gpu_mib_grown'])} MiB; the abort watcher on; the rank lived.", "",
            "### `--profile`", "",
            "```", prof["nccl"]["text"].split("\ntrace:")[0], "", prof["gloo"]["text"].split("\ntrace:")[0], "```", "",
            "One NCCL rank launches no NCCL kernel (none in its trace); the straggler is 2 gloo ranks sharing the GPU "
            "(one GPU cannot hold two NCCL ranks).", "",
            "### The smoke's checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in saved["run"]["checks"]:
        rows.append(f"| {c['check']} | {'PASS' if c['ok'] else 'FAIL'} | {c['detail'].replace('|', '/')} |")
    rows += ["", "Two failures:",
             "- The forkserver check failed on torch's warning \"Can't initialize NVML\", printed in every forkserver "
             "rank's first cell. That warning is silenced in the ranks since. Why NVML does not start there is not "
             "known; torch counts the GPUs with CUDA's runtime instead.",
             "- The pool check's failure is the check's own: it reused a variable. In the run before, it checked "
             "everything else and failed on two things: the GPU history's units (GiB now), and the forkserver's "
             "template left after `%ddp stop` (the kernel's, by design).", "", END]
    block = "\n".join(rows)
    text = results_md.read_text()
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    results_md.write_text(text)


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write transcripts, the dashboard's HTML and smoke.json here")
    ap.add_argument("--only", choices=("all", "round5", "smoke"), default="all",
                    help="round 5's checks (issue 57), the smoke's, or both (round 5 first)")
    ap.add_argument("--check", default="", help="only the checks whose names hold one of these (comma-separated)")
    args = ap.parse_args()
    OUT = args.out
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
    gpus = gpu_count() if DEV != "cpu" else 1
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
    print(f"{gpus} GPU(s): {', '.join(nvml.backend().names()) if DEV != 'cpu' else 'none (a rehearsal on CPU)'}")
    print(f"{'check':28} result  detail")
    checks = (ROUND5 if args.only != "smoke" else []) + (plan_checks(gpus) if args.only != "round5" else [])
    for name, fn in [(n, f) for n, f in checks if any(part in n for part in args.check.split(","))]:
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
        if OUT:  # after each check: a run cut short keeps what it found
            (OUT / f"smoke-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.txt").write_text("\n".join(TRANSCRIPT))
            (OUT / "smoke.json").write_text(json.dumps({"gpus": nvml.backend().names() if DEV != "cpu" else [],
                                                        "checks": results, "round5": FIGURES}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
