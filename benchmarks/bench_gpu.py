"""nbddp's figures on a GPU: python benchmarks/bench_gpu.py [--out DIR] [--quick]

Runs on a machine with an NVIDIA GPU (docs/gpu.md says what to install there), inside one real ipykernel,
each measure interleaved with its anchor in the same run:
  - NCCL one-shot round trip on GPU 0 (launch, process group, one all_reduce on the GPU, teardown):
    a %%ddp --devices 1 cell against a raw fork (torch.multiprocessing, FileStore) and Lightning's
    ddp_notebook where Lightning is installed;
  - a pool's per-cell round trip (one all_reduce on the GPU, synchronised) against the floor: one rank
    forked once into an NCCL group and woken by a byte on a pipe;
  - DDP steps/s in a %%ddp cell against the same loop under torchrun;
  - the live dashboard's cost per tick with NVML sampling the GPU, and one NVML sample alone;
  - launch time with a 10 GiB tensor resident in the kernel against an empty kernel.
Prints the figures; writes bench_gpu.json to DIR (default: benchmarks/, as results_gpu.json, which
`python benchmarks/run.py` renders as results.md's GPU section: see section()).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SAVED = HERE / "results_gpu.json"
sys.path.insert(0, str(HERE))

import kernel_code as kc  # noqa: E402  (the floor, shared with the CPU benchmark)
from gpu_smoke import LOOP, train_script  # noqa: E402  (the DDP loop the smoke test times too)

SETUP = r'''
%load_ext nbddp
import json, os, select, shutil, statistics, subprocess, sys, tempfile, time
import torch, torch.distributed as dist, torch.multiprocessing as tmp

def bench(name, value):
    print("BENCH " + json.dumps({"name": name, "value": value}), flush=True)

ONE_SHOT = "t = torch.ones(1, device=device)\ndist.all_reduce(t)\nt.item()"

def _raw_job(rank, world, path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    t.item()
    torch.cuda.synchronize()
    os._exit(0)  # as nbddp's and Lightning's ranks leave: no NCCL teardown

RAW_RANKS = 1
''' + kc.RAW_ROUND_TRIP_CODE + r'''
def nbddp_round_trip(n=1):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", f"--devices {n}", ONE_SHOT)
    return time.perf_counter() - t0

def _fabric_job(fabric):
    t = torch.ones(1, device=fabric.device)
    dist.all_reduce(t)
    return t.item()

def lightning_round_trip(n=1):
    from lightning_fabric import Fabric
    os.environ.pop("MASTER_PORT", None)
    t0 = time.perf_counter()
    Fabric(accelerator="cuda", devices=n, strategy="ddp_notebook").launch(_fabric_job)
    return time.perf_counter() - t0
'''

ROUND_TRIP = r'''
launchers = {"raw fork": raw_round_trip, "nbddp %%ddp": nbddp_round_trip}
try:
    import lightning_fabric  # noqa: F401
    launchers["Lightning ddp_notebook"] = lightning_round_trip
except ImportError:
    pass
for name, f in list(launchers.items()):
    try:
        f()  # warm-up: first-use imports are not launch cost
    except Exception as e:
        print(f"{name} failed: {e!r}", flush=True)
        launchers.pop(name)
times = {k: [] for k in launchers}
for _ in range({runs}):
    for k, f in launchers.items():
        times[k].append(f())
bench("round_trip", {k: statistics.median(v) for k, v in times.items()})
bench("round_trip_all", times)
'''

POOL = kc.FLOOR_CODE + r'''
FLOOR = floor_start(1, "nccl")  # forked before the pool: its rank holds none of the pool's fds
CELL = "t = torch.ones(1, device=device)\ndist.all_reduce(t)\ntorch.cuda.synchronize()\n;"
def pool_cell():
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", "", CELL)
    return time.perf_counter() - t0

t0 = time.perf_counter()
get_ipython().run_line_magic("ddp", "start --devices 1")
start_s = time.perf_counter() - t0
for _ in range(5):
    pool_cell(); floor_cell()
pool, floor = [], []
for i in range({runs}):
    order = [(pool, pool_cell), (floor, floor_cell)]
    for times, cell in (order if i % 2 else order[::-1]):
        times.append(cell())
get_ipython().run_line_magic("ddp", "stop")
floor_stop(FLOOR)
bench("pool", {"pool": statistics.median(pool), "floor": statistics.median(floor), "start_s": start_s,
               "pool_all": pool, "floor_all": floor})
'''

TRAINING = r'''
script = os.path.join(tempfile.mkdtemp(), "train.py")
with open(script, "w") as f:
    f.write(SCRIPT_SRC)
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
def theirs():
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "1", script], capture_output=True, text=True,
                         timeout=300)
    if "STEPS" not in out.stdout:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.split("STEPS")[1].split()[0])
def ours():
    return get_ipython().run_cell_magic("ddp", "--devices 1 --ranks-output none", "STEPS = {steps}\n" + LOOP_SRC + "steps_per_s")
cell, run = [], []
for i in range({runs}):
    for times, f in ((cell, ours), (run, theirs)) if i % 2 == 0 else ((run, theirs), (cell, ours)):
        times.append(f())
bench("training", {"cell": statistics.median(cell), "torchrun": statistics.median(run), "cell_all": cell,
                   "torchrun_all": run})
'''

DASHBOARD = kc.TICKS_CODE + r'''
from nbddp.hw import nvml
ticks = dashboard_ticks("--devices 1", "import time\nx = torch.randn(4096, 4096, device=device)\n"
                        "t0 = time.time()\nwhile time.time() - t0 < 6.5:\n    x = x @ x / x.norm()\n"
                        "torch.cuda.synchronize()\n")
nv = nvml.backend()
nv.sample([0])
samples = []
for _ in range(200):
    t0 = time.perf_counter(); nv.sample([0]); samples.append(time.perf_counter() - t0)
bench("dashboard", {"ticks": len(ticks), "mean_s": statistics.mean(ticks), "max_s": max(ticks),
                    "nvml_sample_s": statistics.median(samples)})
'''

MEMORY = r'''
res = {}
for gb in (0, 10):
    big = torch.ones(int(gb * 2**30) // 4) if gb else None
    ours, raws = [], []
    for _ in range({runs}):
        ours.append(nbddp_round_trip()); raws.append(raw_round_trip())
    res[gb] = {"nbddp %%ddp": statistics.median(ours), "raw fork": statistics.median(raws)}
    del big
bench("memory", res)
'''


def measures(res) -> dict:
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("BENCH "):
            item = json.loads(line.split("BENCH ", 1)[1])
            out[item["name"]] = item["value"]
    return out


def machine() -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from nbddp.hw import nvml

    return {"gpus": nvml.backend().names(), "cpus": __import__("os").cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}


def run(quick: bool, only: list[str] | None = None) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from kernel import Kernel

    runs = 3 if quick else 7
    results = {"machine": machine()}
    steps = 100 if quick else 300
    cells = [("round_trip", ROUND_TRIP.replace("{runs}", str(runs))),
             ("pool", POOL.replace("{runs}", str(10 * runs))),
             ("training", f"LOOP_SRC = {LOOP!r}\nSCRIPT_SRC = {train_script(steps)!r}\n" + TRAINING.replace("{runs}", str(max(3, runs // 2)))
              .replace("{steps}", str(steps))),
             ("dashboard", DASHBOARD), ("memory", MEMORY.replace("{runs}", str(runs)))]
    for name, code in [c for c in cells if not only or c[0] in only]:  # each in a fresh kernel: an anchor that touched CUDA there cannot spoil the next
        k = Kernel(env={"NBDDP_RUNS_DIR": tempfile.mkdtemp()})
        try:
            k.ok(SETUP)
            t0 = time.perf_counter()
            res = k.run(code, timeout=900)
            got = measures(res)
            if res.error or not got:
                print(f"{name}: FAILED\n{res.error_text}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}", flush=True)
                results[f"{name}_error"] = res.error_text[-3000:] or res.stderr[-3000:]
            results.update(got)
            print(f"done: {name} in {time.perf_counter() - t0:.0f} s: {json.dumps(got.get(name))[:400]}", flush=True)
        finally:
            k.shutdown()
    return results


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms" if x < 0.1 else f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def section(r: dict) -> str:
    """results.md's GPU section, from a saved run (benchmarks/results_gpu.json)."""
    m = r["machine"]
    lines = ["## GPU (issue 22)", "",
             (f"Run {m['date']} on {', '.join(m['gpus'])} ({m['cpus']} CPUs), Python {m['python']}, torch {m['torch']} "
             f"(CUDA {m['cuda']}), NCCL, inside one real ipykernel, each figure interleaved with its anchor. "
             "Regenerate there with `python benchmarks/bench_gpu.py` (docs/gpu.md)."), ""]
    if "round_trip" in r:
        rt = r["round_trip"]
        raw = rt["raw fork"]
        lines += ["### One-shot round trip, 1 NCCL rank on GPU 0 (launch, group, one all_reduce, teardown)", "",
                  "| launcher | median | × raw fork |", "|---|---|---|"]
        lines += [f"| {k} | {ms(v)} | {v / raw:.2f}× |" for k, v in rt.items()]
        lines.append("")
    if "before" in r:
        b = r["before"]["round_trip"]
        lines += [f"Before this issue's fix the ranks destroyed their NCCL group on leaving (and so did the raw fork "
                  f"anchor): nbddp {ms(b['nbddp %%ddp'])}, raw fork {ms(b['raw fork'])}, Lightning "
                  f"{ms(b['Lightning ddp_notebook'])}, same machine, earlier run.", ""]
    if "pool" in r:
        p = r["pool"]
        lines += ["### Pool cell on the GPU (one all_reduce, synchronised)", "",
                  "| what answers the cell | median | × floor |", "|---|---|---|",
                  f"| nbddp pool `%%ddp` | {ms(p['pool'])} | {p['pool'] / p['floor']:.2f}× |",
                  f"| floor: 1 rank forked once into an NCCL group, woken by a byte on a pipe | {ms(p['floor'])} | 1.00× |",
                  "", f"`%ddp start --devices 1` took {ms(p['start_s'])}.", ""]
    if "training" in r:
        t = r["training"]
        ratio = t["cell"] / t["torchrun"]
        lines += ["### DDP training steps/s, 1 GPU (2×Linear(4096), batch 1024, fp32)", "",
                  "| where | steps/s (median) |", "|---|---|",
                  f"| `%%ddp --devices 1` cell | {t['cell']:.1f} |", f"| torchrun --standalone | {t['torchrun']:.1f} |",
                  "", f"Cell / torchrun: {ratio:.3f} (goal ≥ 0.98: {'met' if ratio >= 0.98 else '**not met**'}).", ""]
    if "dashboard" in r:
        d = r["dashboard"]
        lines += ["### Dashboard with NVML", "",
                  (f"{d['ticks']} ticks of the live dashboard over a 6.5 s GPU cell: {ms(d['mean_s'])} each on average, "
                  f"{ms(d['max_s'])} at most (one tick a second). One NVML sample of the GPU alone: "
                  f"{ms(d['nvml_sample_s'])} (median of 200)."), ""]
    if "memory" in r:
        mem = r["memory"]
        empty, big = mem.get("0", mem.get(0)), mem.get("10", mem.get(10))
        lines += ["### Launch with a 10 GiB tensor resident in the kernel (1 NCCL rank, one-shot)", "",
                  "| kernel holds | nbddp %%ddp | raw fork |", "|---|---|---|",
                  f"| nothing | {ms(empty['nbddp %%ddp'])} | {ms(empty['raw fork'])} |",
                  f"| a 10 GiB CPU tensor | {ms(big['nbddp %%ddp'])} | {ms(big['raw fork'])} |", "",
                  (f"10 GiB / empty: nbddp {big['nbddp %%ddp'] / empty['nbddp %%ddp']:.2f}×, raw fork "
                  f"{big['raw fork'] / empty['raw fork']:.2f}×."), ""]
    if "launch_bound" in r:
        lb = r["launch_bound"]["steps_per_s"]
        lines += ["The same loop at batch 256 is bound by the CPU launching kernels, where noise is larger: 1000 steps, "
                  "3 interleaved rounds, steps/s: " + "; ".join(f"{k} {', '.join(f'{v:.0f}' for v in vs)}"
                                                               for k, vs in lb.items()) +
                  ". No systematic gap (the rank sees no audit events per step).", ""]
    if "smoke" in r:
        lines += ["### `python benchmarks/gpu_smoke.py` on this machine", "", "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c['check']} | {'PASS' if c['ok'] else 'FAIL'} | {c['detail'].replace('|', '/')} |"
                  for c in r["smoke"]["checks"]]
        lines += ["", "The live views on this GPU (their HTML, rendered in headless Chromium): the one-shot cell's dashboard "
                  "and the pool's view with GPU utilisation and memory over its life.", "",
                  "![a GPU cell's dashboard](../docs/images/gpu-dashboard.png)", "",
                  "![the pool's view on a GPU](../docs/images/gpu-pool.png)", ""]
    errors = [k for k in r if k.endswith("_error")]
    if errors:
        lines += ["Failed to measure: " + ", ".join(e.removesuffix("_error") for e in errors) + ".", ""]
    return "\n".join(lines)


def render(results_md: Path = HERE / "results.md") -> None:
    """Put the saved GPU section into results.md (replacing an older one)."""
    text = results_md.read_text()
    head, sep, rest = text.partition("## GPU (issue 22)")
    tail = rest[rest.find("\n## "):] if sep and "\n## " in rest else ""
    results_md.write_text(head.rstrip() + "\n\n" + section(json.loads(SAVED.read_text())).rstrip() + "\n" + tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write bench_gpu.json here (default: benchmarks/results_gpu.json)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", choices=["round_trip", "pool", "training", "dashboard", "memory"])
    ap.add_argument("--render", action="store_true", help="only write the saved figures into results.md")
    args = ap.parse_args()
    if args.render:
        render()
        return 0
    results = run(args.quick, args.only)
    target = args.out / "bench_gpu.json" if args.out else SAVED
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(results, indent=1))
    print(section(results))
    return 1 if any(k.endswith("_error") for k in results) else 0


if __name__ == "__main__":
    sys.exit(main())
