"""Code the benchmark runs inside a real ipykernel (sent as a cell); each measure prints one BENCH line."""

RAW_ROUND_TRIP_CODE = r'''
def raw_round_trip(n=RAW_RANKS):
    """The anchor: ranks forked by torch.multiprocessing, meeting on a FileStore, each running _raw_job."""
    d = tempfile.mkdtemp()
    t0 = time.perf_counter()
    tmp.start_processes(_raw_job, args=(n, os.path.join(d, "store")), nprocs=n, start_method="fork")
    dt = time.perf_counter() - t0
    shutil.rmtree(d)
    return dt
'''

SETUP = r'''
%load_ext nbddp
import json, os, pickle, shutil, statistics, subprocess, sys, tempfile, time
import psutil, torch, torch.distributed as dist, torch.multiprocessing as tmp

def bench(name, value):
    print("BENCH " + json.dumps({"name": name, "value": value}), flush=True)

def _raw_job(rank, world, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()

RAW_RANKS = 2
''' + RAW_ROUND_TRIP_CODE + r'''
def nbddp_round_trip(n=2, extra=""):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", f"--devices {n} {extra}", "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    return time.perf_counter() - t0

def _fabric_job(fabric):
    torch.set_num_threads(1)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def lightning_round_trip(n=2):
    from lightning_fabric import Fabric
    os.environ.pop("MASTER_PORT", None)  # Lightning leaves it behind; a stale one collides on rerun
    t0 = time.perf_counter()
    Fabric(accelerator="cpu", devices=n, strategy="ddp_notebook").launch(_fabric_job)
    return time.perf_counter() - t0

def _accelerate_job():
    torch.set_num_threads(1)
    from accelerate import PartialState
    PartialState(cpu=True)
    t = torch.ones(1)
    dist.all_reduce(t)

def accelerate_round_trip(n=2):
    from accelerate import notebook_launcher
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    t0 = time.perf_counter()
    notebook_launcher(_accelerate_job, num_processes=n, use_port=str(port))
    return time.perf_counter() - t0
'''

ROUND_TRIP = r'''
launchers = {"raw fork": raw_round_trip, "nbddp %%ddp": nbddp_round_trip,
             "Lightning ddp_notebook": lightning_round_trip, "Accelerate notebook_launcher": accelerate_round_trip}
for f in launchers.values():
    f()  # warm-up: first-use imports are not launch cost
times = {k: [] for k in launchers}
for _ in range({runs}):
    for k, f in launchers.items():  # interleaved, so drift hits every launcher alike
        times[k].append(f())
bench("round_trip", {k: statistics.median(v) for k, v in times.items()})
'''

PNG = r'''
import zlib, struct
def _png(width, height, seed=0):
    """A valid PNG of random pixels (incompressible): about width * height * 3 bytes."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (height, width * 3 + 1), dtype=torch.uint8, generator=g)
    rows[:, 0] = 0
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows.numpy().tobytes(), 0)) + chunk(b"IEND", b"")
BIG_PNG = _png(580, 580)
from IPython.display import Image
def png_cell(show):
    body = "if rank == 0:\n    display(Image(data=BIG_PNG))\n" if show else "if rank == 0:\n    pass\n"
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", "--devices 2", body)
    return time.perf_counter() - t0
png_cell(True); png_cell(False)
with_png, without = [], []
for _ in range({runs}):
    with_png.append(png_cell(True)); without.append(png_cell(False))
bench("png", {"bytes": len(BIG_PNG), "with": statistics.median(with_png), "without": statistics.median(without)})
'''

SCALING = r'''
res = {}
for n in (1, 2, 4, 8):
    raw, ours = [], []
    for _ in range(5):
        raw.append(raw_round_trip(n)); ours.append(nbddp_round_trip(n))
    res[n] = {"raw fork": statistics.median(raw), "nbddp %%ddp": statistics.median(ours)}
bench("scaling", res)
'''

SHARING = r'''
data = torch.ones(256 * 2**20)  # 1 GiB
reader = "import psutil\ns = data[rank::world_size].sum().item()\nuss = psutil.Process().memory_full_info().uss\n"
def rank_uss(method):
    allr = get_ipython().run_cell_magic("ddp", f"--devices 2 --start-method {method} --ranks-output none -o uss_all",
        reader + "allu = [None] * world_size\ndist.all_gather_object(allu, uss)\nuss_all = allu\n")
    return max(uss_all)
get_ipython().run_cell_magic("ddp", "--devices 2 --ranks-output none", "import psutil")  # baseline imports
base = get_ipython().run_cell_magic("ddp", "--devices 2 --ranks-output none", "import psutil\npsutil.Process().memory_full_info().uss")
bench("sharing", {"dataset": data.numel() * 4, "baseline_uss": base, "fork": rank_uss("fork"), "spawn": rank_uss("spawn")})
del data
'''

RESULTS = r'''
build = "state = {f'layer{i}.weight': torch.randn(1024, 1024) for i in range(25)}  # 100 MiB\n"
def cell(outs):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", f"--devices 2 {outs}", build)
    return time.perf_counter() - t0
def raw_pipe():
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        exec(build, globals())
        blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(blob)
        while view:
            view = view[os.write(w, view):]
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 20):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    pickle.loads(b"".join(chunks))
    return time.perf_counter() - t0
def raw_pipe_no_data():
    pid = os.fork()
    t0 = time.perf_counter()
    if pid == 0:
        exec(build, globals()); os._exit(0)
    os.waitpid(pid, 0)
    return time.perf_counter() - t0
with_out, without, raw, raw0 = [], [], [], []
for _ in range({runs}):
    with_out.append(cell("-o state")); without.append(cell("")); raw.append(raw_pipe()); raw0.append(raw_pipe_no_data())
bench("results", {"nbddp": statistics.median(with_out) - statistics.median(without),
                  "raw pipe": statistics.median(raw) - statistics.median(raw0),
                  "bytes": sum(v.numel() * 4 for v in state.values())})
'''

TRAIN_BODY = r'''import time, torch, torch.distributed as dist
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randn(64, 1)
def step():
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
for _ in range(20):
    step()
dist.barrier()
t0 = time.perf_counter()
for _ in range(300):
    step()
dist.barrier()
steps_per_s = 300 / (time.perf_counter() - t0)
'''

TRAINING = r'''
script = os.path.join(tempfile.mkdtemp(), "train.py")
with open(script, "w") as f:
    f.write("import torch\ntorch.set_num_threads(1)\nimport torch.distributed as dist\n"
            "dist.init_process_group('gloo')\nrank = dist.get_rank()\n" + TRAIN_BODY_SRC +
            "if rank == 0:\n    print('STEPS', steps_per_s)\ndist.destroy_process_group()\n")
torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
ours, theirs = [], []
for _ in range(5):
    ours.append(get_ipython().run_cell_magic("ddp", "--devices 2 --ranks-output none", TRAIN_BODY_SRC + "steps_per_s"))
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", script], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    theirs.append(float(out.stdout.split("STEPS")[1].split()[0]))
bench("training", {"nbddp %%ddp": statistics.median(ours), "torchrun": statistics.median(theirs),
                   "ours_all": ours, "theirs_all": theirs})
'''

RELAY_SLOWDOWN = r'''
body = (
    "import time, statistics\nx = torch.randn(96, 96)\n"
    "t0 = time.perf_counter()\nfor _ in range(2000):\n    x @ x\n"
    "reps = max(1, round(100e-6 / ((time.perf_counter() - t0) / 2000)))  # one step = about 100 us of work\n"
    "def work(loud):\n"
    "    t0 = time.perf_counter()\n"
    "    for i in range(10_000):\n"
    "        for _ in range(reps):\n"
    "            y = x @ x\n"
    "        value = float(y[0, 0])  # the same work in both variants: only the print differs\n"
    "        if loud:\n"
    "            print(f'step {i} value {value:.4f}')\n"
    "    return time.perf_counter() - t0\n"
    "work(False)\n"
    "pairs = []\n"
    "for _ in range(7):  # paired, back to back: machine noise hits both halves of a pair alike\n"
    "    q = work(False); l = work(True); pairs.append((q, l))\n"
    "pairs\n"
)
def summary(pairs):
    ratios = sorted(l / q - 1 for q, l in pairs)
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
            "lines_per_s": 10_000 / statistics.median(l for _, l in pairs)}
shown = get_ipython().run_cell_magic("ddp", "--devices 2", body)
hidden = get_ipython().run_cell_magic("ddp", "--devices 2 --ranks-output none", body)
bench("slowdown", {"shown": summary(shown), "hidden": summary(hidden)})
'''

TICKS_CODE = r'''
def dashboard_ticks(line, body):
    """How long each of the live dashboard's ticks took while a %%ddp cell ran (also benchmarks/bench_gpu.py)."""
    import nbddp.views.dashboard as D
    ticks, tick = [], D.RunView.tick
    def timed_tick(self):
        t0 = time.perf_counter(); tick(self); ticks.append(time.perf_counter() - t0)
    D.RunView.tick = timed_tick
    try:
        get_ipython().run_cell_magic("ddp", line, body)
    finally:
        D.RunView.tick = tick
    return ticks
'''

DASHBOARD_COST = TICKS_CODE + r'''
import nbddp.views.monitor as _M
samples, _sample = [], _M.Monitor.sample
def _timed_sample(self, *args, **kwargs):
    t0 = time.perf_counter(); _sample(self, *args, **kwargs); samples.append(time.perf_counter() - t0)
_M.Monitor.sample = _timed_sample
try:
    ticks = dashboard_ticks("--devices 2", "import time\nx = torch.zeros(2**20)\ntime.sleep(6.5)")
finally:
    _M.Monitor.sample = _sample
# the anchor, in the same kernel: what any live output updated at 1 Hz costs, a bare display update of a
# bundle the dashboard's size (no sampling, no rendering)
from IPython.display import publish_display_data
bundle = {"text/html": "<div>" + "x" * 3000 + "</div>", "text/plain": "x" * 600}
publish_display_data(bundle, transient={"display_id": "bench-anchor"})
updates = []
for i in range(len(ticks)):
    t0 = time.perf_counter()
    publish_display_data({**bundle, "text/plain": str(i)}, transient={"display_id": "bench-anchor"}, update=True)
    updates.append(time.perf_counter() - t0)
    time.sleep(0.2)
bench("dashboard", {"ticks": len(ticks), "mean_s": statistics.mean(ticks), "max_s": max(ticks),
                    "sample_mean_s": statistics.mean(samples), "anchor_update_s": statistics.mean(updates)})
'''

MEMORY = r'''
res = {}
for gb in (0, 0.5, 2, 4, 8):
    big = torch.ones(int(gb * 2**30) // 4) if gb else None
    times, raws = [], []
    for _ in range(5):
        times.append(nbddp_round_trip()); raws.append(raw_round_trip())
    uss = get_ipython().run_cell_magic("ddp", "--devices 2 --ranks-output none",
        "import psutil\nif big is not None:\n    big[rank::1024].sum()\npsutil.Process().memory_full_info().uss")
    res[gb] = {"nbddp %%ddp": statistics.median(times), "raw fork": statistics.median(raws), "rank_uss": uss}
    del big
bench("memory", res)
'''

FLOOR_CODE = r"""
import select
from nbddp.wire import framing as _framing, messages as _messages
from nbddp.views import iopub as _iopub

# the floor: ranks forked once from this kernel into a process group (gloo on CPU, or NCCL on the GPUs), each
# waiting on a command pipe; a cell is one byte to each rank, one all_reduce (synchronised on a GPU), one byte
# back from each. Nothing of nbddp in it. benchmarks/bench_gpu.py measures its pool against it too.
# The wire floor: the same ranks, spoken to as nbddp speaks to a pool's: a framed, pickled RunCell in, its
# source compiled once and exec'd in the rank's copy of the notebook's namespace, a framed Result back, and
# the cell's one line queued for the client. Nothing else of nbddp (no options, no namespace rule, no failure
# rules, no relay or dashboard): the least any engine on this wire can cost.
FLOOR_GO, FLOOR_QUIT = b"g", b"q"  # (the pipes' write ends are open in every process forked later: no EOF)
WIRE_CELL = "t = torch.ones(1)\ndist.all_reduce(t)\n"

def _floor_rank(rank, world, backend, store_path, cmd_r, reply_w, wire):
    code = 1
    try:
        cuda = backend == "nccl"
        if cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        os.write(reply_w, b"r")  # ready
        if wire:
            _wire_serve(cmd_r, reply_w)
        else:
            while os.read(cmd_r, 1) == FLOOR_GO:  # FLOOR_QUIT, or EOF if the kernel is gone: leave
                t = torch.ones(1, device="cuda" if cuda else "cpu")  # the same work as the pool's (and %%px's) cell
                dist.all_reduce(t)
                if cuda:
                    torch.cuda.synchronize()
                os.write(reply_w, b"d")
        dist.destroy_process_group()
        code = 0
    except BaseException as e:
        os.write(2, f"floor rank {rank}: {e!r}\n".encode())
    finally:
        os._exit(code)

def _wire_serve(cmd_r, reply_w):
    ns, compiled = get_ipython().user_ns, {}  # the notebook's namespace, this rank's copy since the fork
    reader, writer = _framing.Reader(), _framing.Writer(reply_w)
    while data := os.read(cmd_r, 1 << 16):
        for cmd, _ in reader.feed(data):
            if isinstance(cmd, _messages.Stop):
                return
            code = compiled.get(cmd.source)
            if code is None:
                code = compiled[cmd.source] = compile(cmd.source, cmd.filename, "exec")
            exec(code, ns)
            writer.send(_messages.Result())

def _floor_read(fds, timeout=60, readers=None):
    # one answer from each rank: a byte (the floor's), or a whole frame (the wire floor's: readers)
    for i, fd in enumerate(fds):
        whole = False
        while not whole:
            if not select.select([fd], [], [], timeout)[0]:
                raise TimeoutError("a floor rank did not answer")
            data = os.read(fd, 1 if readers is None else 1 << 16)
            if not data:
                raise RuntimeError("a floor rank died")
            whole = readers is None or bool(readers[i].feed(data))

def floor_start(world=2, backend="gloo", wire=False):
    d = tempfile.mkdtemp()
    pids, cmd, reply = [], [], []
    for rank in range(world):
        c_r, c_w = os.pipe()
        r_r, r_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in cmd + reply + [c_w, r_r]:  # the kernel's ends, and the other ranks'
                os.close(fd)
            _floor_rank(rank, world, backend, os.path.join(d, "store"), c_r, r_w, wire)
        os.close(c_r); os.close(r_w)
        pids.append(pid); cmd.append(c_w); reply.append(r_r)
    quit = _framing.encode(_messages.Stop()) if wire else FLOOR_QUIT
    try:
        _floor_read(reply, timeout=120)
    except BaseException:
        floor_stop((d, pids, cmd, reply, quit))
        raise
    return d, pids, cmd, reply, quit

def floor_cell():
    t0 = time.perf_counter()
    for fd in FLOOR[2]:
        os.write(fd, FLOOR_GO)
    _floor_read(FLOOR[3])
    return time.perf_counter() - t0

def wire_cell():
    t0 = time.perf_counter()
    frame = _framing.encode(_messages.RunCell(WIRE_CELL, "<cell>", (), (), 1 << 20, {}))
    for fd in WIRE[2]:
        _framing.write_all(fd, frame)
    _floor_read(WIRE[3], readers=WIRE_READERS)
    dt = time.perf_counter() - t0
    _iopub.publish_line(f"wire floor · 2 ranks · {dt * 1000:.2f} ms", False)
    return time.perf_counter() - t0

def floor_stop(floor):
    d, pids, cmd, reply, quit = floor
    for fd in cmd:
        try:
            _framing.write_all(fd, quit)
        except OSError:
            pass
    codes = []
    for pid in pids:
        deadline = time.monotonic() + 30
        while (got := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if got[0] == 0:
            os.kill(pid, 9)
            got = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(got[1]))
    for fd in cmd + reply:
        os.close(fd)
    shutil.rmtree(d, ignore_errors=True)
    if any(codes):
        raise RuntimeError(f"floor ranks exited with {codes}")
"""

POOL = FLOOR_CODE + r"""
import ipyparallel as ipp, io, contextlib

FLOOR = floor_start()  # forked first, before ipyparallel and the pool: the floor's ranks hold none of their fds
WIRE = floor_start(wire=True)
WIRE_READERS = [_framing.Reader() for _ in WIRE[3]]
cluster = ipp.Cluster(n=2, log_level=40)
rc = cluster.start_and_connect_sync()
rc.wait_for_engines(2, timeout=120)
view = rc[:]
view.activate()  # %%px
store = os.path.join(tempfile.mkdtemp(), "store")
view.scatter("engine_rank", [0, 1], flatten=True, block=True)
view.execute(f"import torch, torch.distributed as dist\ntorch.set_num_threads(1)\n"
             f"dist.init_process_group('gloo', init_method='file://{store}', rank=engine_rank, world_size=2)",
             block=True)
CELL = "t = torch.ones(1)\ndist.all_reduce(t)\n"
def px_cell():
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("px", "--block", CELL)
    return time.perf_counter() - t0
def pool_cell():
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("ddp", "", CELL.rstrip() + ";")  # silenced (a ";" line of its own is IPython's autoquote)
    return time.perf_counter() - t0
get_ipython().run_line_magic("ddp", "start --devices 2")
for _ in range(5):
    px_cell(); pool_cell(); floor_cell(); wire_cell()
px, pool, floor, wire = [], [], [], []
order = [(px, px_cell), (pool, pool_cell), (floor, floor_cell), (wire, wire_cell)]
for i in range({runs}):  # each goes first, second, ... equally often: a cell pays for the last one's wake
    for times, cell in order[i % 4:] + order[:i % 4]:
        times.append(cell())
# the pool and the floors alone, in turn: %%px leaves its engines and hub busy for a while after it
# returns, and whichever cell comes next pays for it (the floor most, being the shortest)
pair_pool, pair_floor, pair_wire = [], [], []
trio = [(pair_pool, pool_cell), (pair_floor, floor_cell), (pair_wire, wire_cell)]
for i in range({runs}):
    for times, cell in trio[i % 3:] + trio[:i % 3]:
        times.append(cell())
floor_stop(FLOOR)
floor_stop(WIRE)
one_shot = []
get_ipython().run_line_magic("ddp", "stop")
for _ in range(5):
    one_shot.append(nbddp_round_trip())
view.execute("dist.destroy_process_group()", block=True)
rc.shutdown(hub=True) if hasattr(rc, "shutdown") else None
cluster.stop_cluster_sync()
bench("pool", {"ipyparallel": statistics.median(px), "pool": statistics.median(pool),
               "floor": statistics.median(floor), "wire": statistics.median(wire),
               "one_shot": statistics.median(one_shot), "pair_pool": statistics.median(pair_pool),
               "pair_floor": statistics.median(pair_floor), "pair_wire": statistics.median(pair_wire),
               "px_all": px, "pool_all": pool, "floor_all": floor})

# memory: a 1 GiB tensor built before the start; a 100 MiB tensor made after it, read by five cells
BIG = torch.ones(2**28)  # 1 GiB of float32
get_ipython().run_line_magic("ddp", "start --devices 2")
get_ipython().run_cell_magic("ddp", "", "s = BIG[rank::2].sum().item()\n;")
from nbddp.kernel import magic as _m
pool_obj = [m for m in get_ipython().magics_manager.registry.values() if isinstance(m, _m.DDPMagics)][0].pool
uss = [psutil.Process(p.pid).memory_full_info().uss for p in pool_obj.gang.sup.procs]
LATE = torch.ones(25 * 2**20)  # 100 MiB, after the start
notes = io.StringIO()
with contextlib.redirect_stderr(notes):
    for _ in range(5):
        get_ipython().run_cell_magic("ddp", "", "s = LATE.sum().item()\n;")
get_ipython().run_line_magic("ddp", "stop")
bench("pool_memory", {"dataset": BIG.numel() * 4, "rank_uss": uss, "late_bytes": LATE.numel() * 4,
                      "sent_notes": notes.getvalue().count("sent LATE")})
"""

FSDP_BODY = r'''import torch.distributed as dist, gc
from torch.distributed.fsdp import fully_shard
def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
def held(model, opt):
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    params = sum(local(p).nbytes for p in model.parameters())
    grads = sum(local(p.grad).nbytes for p in model.parameters() if p.grad is not None)
    state = sum(local(v).nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return params + grads + state
def train(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 1024)
    for _ in range(3):
        opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    return held(model, opt)
ddp_bytes = train(torch.nn.parallel.DistributedDataParallel(build()))
gc.collect()
m = build()
for layer in m:
    fully_shard(layer)
fully_shard(m)
mem = {"ddp": ddp_bytes, "fsdp2": train(m), "world_size": world_size}
'''

FSDP_MEMORY = (
    "get_ipython().run_cell_magic('ddp', '--devices 2 --gather mem', " + repr(FSDP_BODY) + ")\n"
    "bench('fsdp_memory', mem)\n"
)
