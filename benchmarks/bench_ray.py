"""Issue 24's figures: a pool across two Ray nodes against the one-machine pool and ipyparallel, in one run.

python benchmarks/bench_ray.py [--quick]   (benchmarks/run.py runs it too, when Ray is installed)

Two raylets on this host (ray.cluster_utils.Cluster), 2 CPU ranks, gloo, inside one real ipykernel. Rounds
alternate a local pool (``%ddp start --devices 2``) and a Ray pool (``--cluster ray --nodes 2 --devices 1``:
rank 0 forked from the kernel, rank 1 by the agent on the other raylet); in each, the trivial all_reduce
cell and ipyparallel's ``%%px --block`` (2 engines in a gloo group) alternate. Startup is what
``%ddp start --cluster ray`` reports after ``ray.init``, twice a round: first with no agent kept on the other
node (``placement.release_agents()`` before it: a Ray worker starts there and imports torch, as at a
kernel's first pool), then with the agent the kernel kept from that pool (a later start, ``%ddp restart``).
The relay figure is lines/s as a client sees them, every line printed by a rank on each node, with the local
pool's and the kernel's own printing as anchors. The machine's load average is noted at the start and the end.
Writes results.json's "ray" entry and the Ray section of results.md (the rest of the file is left as is).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from kernel import Kernel  # noqa: E402

BEGIN, END = "<!-- ray:begin -->", "<!-- ray:end -->"

KERNEL_SETUP = r'''
%load_ext nbddp
import json, os, statistics, tempfile, time
import torch, torch.distributed as dist
import ipyparallel as ipp
import ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
def bench(name, value):
    print("BENCH " + json.dumps({{"name": name, "value": value}}), flush=True)
cluster = ipp.Cluster(n=2, log_level=40)
rc = cluster.start_and_connect_sync()
rc.wait_for_engines(2, timeout=120)
view = rc[:]
view.activate()
view.scatter("engine_rank", [0, 1], flatten=True, block=True)
view.execute("import torch, torch.distributed as dist\ntorch.set_num_threads(1)\n"
             f"dist.init_process_group('gloo', init_method='file://{{tempfile.mkdtemp()}}/store', rank=engine_rank, "
             "world_size=2)", block=True)
CELL = "t = torch.ones(1)\ndist.all_reduce(t)\n"
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
@ray.remote(num_cpus=0)
class Echo:  # Ray's own round trip to the other raylet: one call, one reply, nothing of nbddp's
    def ping(self):
        return None
_other = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != ray.get_runtime_context().get_node_id()]
ON_NODE_1 = NodeAffinitySchedulingStrategy(_other[0], soft=False)
ECHO = Echo.options(scheduling_strategy=ON_NODE_1).remote()
ray.get(ECHO.ping.remote(), timeout=120)
@ray.remote(num_cpus=0)
class Cold:  # what a first start waits for at least: a Ray worker started on the other raylet, torch imported
    def __init__(self):
        import torch  # noqa: F401
    def ready(self):
        return None
def cold_start():
    t0 = time.perf_counter()
    actor = Cold.options(scheduling_strategy=ON_NODE_1).remote()
    ray.get(actor.ready.remote(), timeout=120)
    bench("cold", time.perf_counter() - t0)
    ray.kill(actor)
def trip():
    t0 = time.perf_counter()
    ray.get(ECHO.ping.remote())
    return time.perf_counter() - t0
def timed(magic, line):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic(magic, line, CELL.rstrip() + ";")  # silenced (";" on a line of its own is autoquote)
    return time.perf_counter() - t0
def block(name, n):
    """n pool cells, n %%px cells and n bare Ray round trips, each first, second and third in turn."""
    for _ in range(3):
        timed("ddp", ""); timed("px", "--block"); trip()
    pool, px, trips = [], [], []
    order = [(pool, lambda: timed("ddp", "")), (px, lambda: timed("px", "--block")), (trips, trip)]
    for i in range(n):
        for times, measure in order[i % 3:] + order[:i % 3]:
            times.append(measure())
    bench(name, {{"pool": pool, "px": px, "trip": trips}})
None
'''

TEARDOWN = r'''
view.execute("dist.destroy_process_group()", block=True)
cluster.stop_cluster_sync()
ray.shutdown()
'''


def measures(res) -> dict:
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("BENCH "):
            item = json.loads(line[6:])
            out[item["name"]] = item["value"]
    return out


def import_ray_s(runs: int = 3) -> dict:
    """How long a fresh Python takes to ``import ray`` (every Ray worker does, before any of nbddp's code runs),
    as installed here and with jsonschema's optional ``rfc3987_syntax`` hidden (Jupyter's jupyter-events pulls it
    in; jsonschema imports it if it is there, and it builds a grammar on import). Medians of ``runs``."""
    import subprocess

    def once(prelude: str) -> float:
        code = f"import time; t = time.perf_counter(); {prelude}import ray; print(time.perf_counter() - t)"
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)

    return {"as_installed": statistics.median(once("") for _ in range(runs)),
            "without_rfc3987_syntax": statistics.median(once("import sys; sys.modules['rfc3987_syntax'] = None; ")
                                                         for _ in range(runs))}


def started(res) -> float:
    m = re.search(r"ready in ([\d.]+) s", res.stdout)
    assert m, res.stdout + res.stderr
    return float(m.group(1))


def relay(k: Kernel, lines: int, runs: int = 3) -> float:
    """Lines/s a client sees (median of ``runs``): each rank prints ``lines`` lines of its own."""
    k.ok("%%ddp\nfor i in range(100):\n    print(rank, i)\n")  # warm-up
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        res = k.ok(f"%%ddp --max-lines {lines}\nfor i in range({lines}):\n    print(f'{{rank}} line {{i}}')\n",
                   timeout=300)
        seconds = time.perf_counter() - t0
        got = res.stdout.count("\n")
        assert got >= 2 * lines, got
        rates.append(got / seconds)
    return statistics.median(rates)


def measure(quick: bool = False) -> dict:
    from ray.cluster_utils import Cluster

    rounds, n, lines = (2, 10, 20_000) if quick else (3, 30, 100_000)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    k = Kernel(env={"NBDDP_RUNS_DIR": tempfile.mkdtemp()})
    out = {"local": [], "ray": [], "px": [], "trip": [], "startup_first_s": [], "startup_later_s": [], "cold_s": [],
           "relay_ray": 0.0, "relay_local": 0.0, "load": [os.getloadavg()[0]]}
    try:
        k.ok(KERNEL_SETUP.format(address=c.address), timeout=300)
        pools = (("local", "--devices 2"), ("ray", "--cluster ray --nodes 2 --devices 1"))
        for r in range(rounds):
            for name, options in pools:
                if name == "ray":  # a first start (no agent kept), then a later one (the kept agent)
                    k.ok("from nbddp.cluster import placement\nplacement.release_agents()", timeout=60)
                    out["cold_s"].append(measures(k.ok("cold_start()", timeout=180))["cold"])
                    out["startup_first_s"].append(started(k.ok(f"%ddp start {options}", timeout=120)))
                    k.ok("%ddp stop", timeout=60)
                res = k.ok(f"%ddp start {options}", timeout=120)
                if name == "ray":
                    out["startup_later_s"].append(started(res))
                got = measures(k.ok(f"block({name!r}, {n})", timeout=600))[name]
                out[name] += got["pool"]
                out["px"] += got["px"]
                out["trip"] += got["trip"]
                if r == rounds - 1:
                    out[f"relay_{name}"] = relay(k, lines)
                k.ok("%ddp stop", timeout=60)
            print(f"round {r + 1}/{rounds} done", flush=True)
        t0 = time.perf_counter()  # the anchor: the kernel itself printing as many prefixed lines
        res = k.ok(f"import sys\nsys.stdout.write(''.join(f'[rank{{i % 2}}]:{{i % 2}} line {{i}}\\n' "
                   f"for i in range({2 * lines})))", timeout=300)
        out["relay_kernel"] = res.stdout.count("\n") / (time.perf_counter() - t0)
        k.ok(TEARDOWN, timeout=120)
    finally:
        k.shutdown()
        c.shutdown()
    import ray

    out["import_ray_s"] = import_ray_s()
    out["load"].append(os.getloadavg()[0])
    out.update(lines=2 * lines, cells=len(out["ray"]), ray_version=ray.__version__)
    return out


def section(r: dict) -> str:
    med = {key: statistics.median(r[key]) for key in ("local", "ray", "px")}
    ratio, vs_px = med["ray"] / med["local"], med["ray"] / med["px"]
    first, later = (statistics.median(r[f"startup_{k}_s"]) for k in ("first", "later"))
    trip = statistics.median(r["trip"]) if r.get("trip") else None  # (absent from runs before it was measured)
    rows = [
        f"## 8. A pool across two Ray nodes (`%ddp start --cluster ray --nodes 2 --devices 1`), Ray {r['ray_version']}",
        "",
        "Two raylets on this host (`ray.cluster_utils.Cluster`); rank 0 forked from the kernel, rank 1 by the agent "
        "on the other raylet; the same trivial all_reduce cell as section 1c, medians of "
        f"{r['cells']} cells each, local and Ray pools in alternating rounds, `%%px --block` interleaved with each. "
        + (f"Load average {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end (2 cores, shared)."
           if "load" in r else ""),
        "",
        "| what answers the cell | median | × local pool |",
        "|---|---|---|",
        f"| nbddp pool across 2 Ray nodes | {med['ray'] * 1000:.2f} ms | {ratio:.2f}× |",
        f"| nbddp local pool (`--devices 2`), same run | {med['local'] * 1000:.2f} ms | 1.00× |",
        f"| ipyparallel `%%px --block`, same run | {med['px'] * 1000:.2f} ms | {med['px'] / med['local']:.2f}× |",
        *([f"| Ray's own round trip to an actor on the other raylet (one call, one reply; nothing of nbddp's), same "
           f"run | {trip * 1000:.2f} ms | {trip / med['local']:.2f}× |"] if trip else []),
        "",
        "| measure | figure |",
        "|---|---|",
        f"| startup: `%ddp start --cluster ray --nodes 2` after `ray.init`, as it reports: first start, no agent "
        f"kept on node 1 (a Ray worker starts there and imports torch; median of {len(r['startup_first_s'])}) | "
        f"{first:.2f} s ({', '.join(f'{s:.2f}' for s in r['startup_first_s'])}) |",
        *([f"| anchor: a Ray actor started on node 1 that imports torch, ready (Ray alone; just before each first "
           f"start) | {statistics.median(r['cold_s']):.2f} s ({', '.join(f'{s:.2f}' for s in r['cold_s'])}) |"]
          if r.get("cold_s") else []),
        f"| startup: a later start of the same kernel (`%ddp restart`, or start after stop): the agent kept from its "
        f"last pool (median of {len(r['startup_later_s'])}) | "
        f"{later:.2f} s ({', '.join(f'{s:.2f}' for s in r['startup_later_s'])}) |",
        f"| relay across nodes: 2 ranks × {r['lines'] // 2:,} lines, one rank per node, to the client "
        f"(median of 3) | {r['relay_ray']:,.0f} lines/s |",
        f"| anchor: the local pool, same cell | {r['relay_local']:,.0f} lines/s |",
        f"| anchor: the kernel itself printing the same lines | {r['relay_kernel']:,.0f} lines/s |",
        "",
        f"Targets (issue 24): the cell ≤ 1.5× the local pool's — {ratio:.2f}×, {_verdict(ratio <= 1.5)}; below "
        f"`%%px --block` — {vs_px:.2f}×, {_verdict(vs_px < 1)}; startup < 3 s — first start {first:.2f} s, "
        f"{_verdict(first < 3)}, a later start {later:.2f} s, {_verdict(later < 3)}; relay > 500,000 lines/s across "
        f"nodes — {r['relay_ray']:,.0f}, "
        f"{_verdict(r['relay_ray'] > 500_000)}.",
    ]
    if trip:
        left = 1.5 * med["local"] - trip
        rows += ["", f"What the cell target leaves: Ray's bare round trip to the other raylet takes {trip * 1000:.2f} ms, "
                 f"{trip / med['local']:.2f}× the local pool's whole cell. A cell across nodes sends rank 1's command and "
                 "gets its answer that way, so 1.5× the local cell leaves "
                 f"{left * 1000:.2f} ms for all the rest: rank 1 running the cell (reading its command, the all_reduce "
                 "with rank 0, sending its answer: 0.5–0.6 ms of a local cell, traced), the agent's hops between Ray "
                 "and the rank's pipes, and the kernel's own work before the command goes out and after the answer "
                 "comes back. The kernel's work before Ray's submit and the local rank's part do overlap Ray's transit."]
    if r.get("cold_s"):
        cold = statistics.median(r["cold_s"])
        rows += ["", f"What the startup target leaves: Ray alone takes {cold:.2f} s to start a worker on node 1 and import "
                 f"torch in it (the anchor above); nbddp's first start takes {first:.2f} s, {first - cold:+.2f} s more "
                 "(placement, forking the ranks, meeting in the process group). Where the anchor is near 3 s, so is "
                 "any first start; a later start, and a first start after `placement.prestart()`, skip it."]
        if r.get("import_ray_s"):
            imp = r["import_ray_s"]
            rows += ["", f"Most of a Ray worker's start here is its `import ray`: {imp['as_installed']:.2f} s in a fresh "
                     f"Python, {imp['without_rfc3987_syntax']:.2f} s with jsonschema's optional `rfc3987_syntax` hidden "
                     "(Jupyter's jupyter-events installs it; jsonschema, which Ray imports, imports it when it is there, "
                     "and it builds a grammar as it does). A node whose Python lacks it starts a worker "
                     f"{imp['as_installed'] - imp['without_rfc3987_syntax']:.1f} s sooner (medians of 3)."]
    return "\n".join(rows) + "\n"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def write(r: dict) -> str:
    """results.json's "ray" entry and results.md's Ray section (between its markers, or appended)."""
    path = HERE / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["ray"] = r
    path.write_text(json.dumps(results, indent=1))
    text = section(r)
    md = HERE / "results.md"
    old = md.read_text() if md.exists() else ""
    block = f"{BEGIN}\n{text}{END}\n"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END) + 1:]
    else:
        new = old.rstrip("\n") + "\n\n" + block
    md.write_text(new)
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer cells and lines (a smoke run)")
    args = parser.parse_args()
    t0 = time.monotonic()
    r = measure(args.quick)
    r["seconds"] = time.monotonic() - t0
    print(write(r))


if __name__ == "__main__":
    main()
