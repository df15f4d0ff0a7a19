"""Issue 55 through a real kernel: a pool that survives a lost rank. The loss known at once (no cell run), the
survivors' state kept, a replacement healed from a peer (rank-specific names listed, never copied), DDP made
anew on the new group; shrink and resize; faults of the healing itself end the pool with the reason, and leave
nothing behind (the clean_kernel fixture checks every process)."""
import os
import re
import signal
import time

import pytest

from helpers import POOL, pool_pids
from kernel import said

pytestmark = pytest.mark.timeout(240)

BUILD = ("%%ddp\nfrom torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)\n"
         "model = DDP(torch.nn.Linear(4, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "data = torch.arange(100_000.)\nshard = data[rank::world_size]\nmine = rank * 10\n"
         "def step():\n    opt.zero_grad()\n    model(torch.ones(8, 4) * shard[:8, None]).pow(2).mean().backward()\n"
         "    opt.step()\nstep()\n")
CHECK = ("%%ddp --gather w have\nshard = data[rank::world_size]\nstep()\nw = model.module.weight.detach().clone()\n"
         "have = (rank, world_size, os.environ['RANK'], os.environ['WORLD_SIZE'], 'mine' in globals(), "
         "data.sum().item())\n")


@pytest.fixture
def pool3(clean_kernel):
    k = clean_kernel
    k.ok("import torch.distributed as dist")
    yield k
    k.ok("%ddp stop")
    assert not [n for n in os.listdir("/dev/shm") if "nbddp" in n], "no shared memory entry left"


def start(k, devices=3, on_loss=None):
    res = k.ok(f"%ddp start --devices {devices}" + (f" --on-loss {on_loss}" if on_loss else ""))
    assert f"pool of {devices} rank(s)" in res.stdout, res.stdout
    k.ok(BUILD)
    return pool_pids(k)


def weights_and_places(k):
    res = k.ok(CHECK, timeout=120)
    w = k.value("[t.tolist() for t in w]")
    assert all(x == w[0] for x in w), f"the replicas trained on together: {w}"
    return res, k.value("have")


def wait_for(k, expr, deadline_s=10.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if k.value(expr):
            return True
        time.sleep(0.05)
    return False


def test_a_rank_killed_while_idle_is_known_at_once_and_healed_from_a_peer(pool3):
    k = pool3
    pids = start(k)
    killed_at = time.time()
    os.kill(pids[2], signal.SIGKILL)
    assert wait_for(k, f"bool({POOL}.losses.history) and not {POOL}.losses.pending"), "said and mended, no cell run"
    seen = k.value(f"{POOL}.losses.history[-1].at")
    assert seen - killed_at < 1.0, f"the loss was known {seen - killed_at:.2f} s after the kill"
    status = k.ok("%ddp status").displays[-1]["data"]["text/plain"]
    assert "rank 2 lost while idle: killed by SIGKILL" in status and "healed the pool in" in status, status
    assert re.search(r"lacking: mine \(Cell In\[\d+\]\), shard \(Cell In\[\d+\]\)", status), status
    res, places = weights_and_places(k)
    # what healing said comes first in the next cell's output: rank-specific names with the cell that bound them
    assert "nbddp: healed the pool in" in res.stderr and "took 5 name(s) from rank 0" in res.stderr, res.stderr
    assert "(DDP, data, model, opt, step)" in res.stderr, res.stderr
    assert "made anew on the new process group: model (DistributedDataParallel)" in res.stderr, res.stderr
    assert "rank(s) 2 lack these names; run the cells that bound them again:" in res.stderr, res.stderr
    assert "mine (Cell In[" in res.stderr and "its value differs between ranks (made from rank)" in res.stderr
    assert places == [(r, 3, str(r), "3", r != 2, 4999949824.0) for r in range(3)], places
    new = pool_pids(k)
    assert new[:2] == pids[:2] and new[2] != pids[2], "the survivors kept their processes"


def test_a_rank_lost_in_a_collective_fails_the_cell_on_every_survivor_then_the_pool_heals(pool3):
    k = pool3
    start(k)
    t0 = time.monotonic()
    res = k.run("%%ddp\nimport signal, time\nfor i in range(100):\n    if rank == 0 and i == 3:\n"
                "        os.kill(os.getpid(), signal.SIGKILL)\n    step()\n    time.sleep(0.02)\n", timeout=60)
    assert time.monotonic() - t0 < 10, "the survivors were freed within 10 s"
    text = res.error_text
    assert "rank 0 failed: killed by SIGKILL" in text and "healed the pool in" in text, text
    assert "a new rank 0 took" in text and "from rank 1" in text, text
    _, places = weights_and_places(k)
    assert [p[:2] for p in places] == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.parametrize("how", ["os._exit(3)", "import ctypes; ctypes.string_at(0)"])
def test_os_exit_and_a_segfault_are_losses_healed_alike(pool3, how):
    k = pool3
    start(k)
    res = k.run(f"%%ddp\nif rank == 1:\n    {how}\nstep()\n", timeout=60)
    cause = "exited with code 3" if "_exit" in how else "killed by SIGSEGV"
    assert f"rank 1 failed: {cause}" in res.error_text and "healed the pool" in res.error_text, res.error_text
    weights_and_places(k)


def test_two_ranks_lost_leave_one_survivor_who_cannot_vouch_for_the_names(pool3):
    k = pool3
    pids = start(k)
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[2], signal.SIGKILL)
    assert wait_for(k, f"len({POOL}.losses.history) == 2 and not {POOL}.losses.pending"), \
        k.value(f"({POOL}.ended, [l.line() for l in {POOL}.losses.history])")
    res = k.ok("%%ddp --gather has\nhas = sorted(n for n in ('data', 'model', 'mine') if n in globals())\n")
    assert k.value("has") == [["data", "mine", "model"], [], []], "nothing a single survivor holds is copied"
    assert "only one survivor holds it" in res.stderr, res.stderr
    k.ok(BUILD)  # the cell that built them, run again
    weights_and_places(k)


def test_shrink_renumbers_the_survivors_in_a_group_of_n_minus_1(pool3):
    k = pool3
    pids = start(k, on_loss="shrink")
    os.kill(pids[0], signal.SIGKILL)
    assert wait_for(k, f"not {POOL}.losses.pending and {POOL}.gang.world_size == 2")
    res, places = weights_and_places(k)
    assert "shrank the pool" in res.stderr and "(1→0, 2→1)" in res.stderr, res.stderr
    assert "mine (Cell In[" in res.stderr, "a name made from the old rank is named"
    assert [p[:4] for p in places] == [(0, 2, "0", "2"), (1, 2, "1", "2")], places
    assert pool_pids(k) == pids[1:]
    assert k.value(f"[__import__('nbddp.kernel.debugger.rankdebug', fromlist=['_'])._ranks[0].ranks[p][0] "
                   f"for p in {pids[1:]}]") == [0, 1], "the debugger panel names the ranks by their new numbers"


def test_resize_grows_and_shrinks_a_live_pool_keeping_its_state(pool3):
    k = pool3
    start(k, devices=2)
    res = k.ok("%ddp resize 3", timeout=120)
    assert "resized the pool from 2 to 3 ranks" in res.stdout and "took 5 name(s) from rank 0" in res.stdout, res.stdout
    _, places = weights_and_places(k)
    assert [p[:5] for p in places] == [(0, 3, "0", "3", True), (1, 3, "1", "3", True), (2, 3, "2", "3", False)]
    res = k.ok("%ddp resize 2", timeout=120)
    assert "resized the pool from 3 to 2 ranks" in res.stdout, res.stdout
    _, places = weights_and_places(k)
    assert len(places) == 2 and len(pool_pids(k)) == 2
    assert "whole number" in k.run("%ddp resize zero").error_text


BOMB = ("%%ddp\nclass Bomb:\n    calls = 0\n    def __reduce__(self):\n        Bomb.calls += 1\n"
        "        if rank == {rank} and Bomb.calls == {call}:\n            os.kill(os.getpid(), 9)\n"
        "        return (int, ())\nbomb = Bomb()\n")


@pytest.mark.parametrize("rank,call,step", [(1, 1, "fingerprinting the pool's names"),
                                            (0, 2, "rank 0 sent the pool's names")])
def test_a_second_rank_lost_while_healing_ends_the_pool_with_the_reason(pool3, rank, call, step):
    k = pool3
    pids = start(k)
    k.ok(BOMB.format(rank=rank, call=call))
    os.kill(pids[2], signal.SIGKILL)
    assert wait_for(k, f"{POOL}.ended is not None", 30)
    why = k.value(f"{POOL}.ended")
    assert f"could not be mended: rank {rank} was lost too while {step}: killed by SIGKILL" in why, why
    res = k.run("%%ddp\nprint(1)\n")
    assert "the pool has ended" in res.error_text, res.error_text


def test_a_replacement_that_cannot_start_shrinks_the_pool_saying_why_and_resize_grows_it_back(pool3):
    """Item 6: no new rank can start (no memory): the survivors, whole, go on at N-1 rather than end, and the
    cell says why and how to grow back; once there is room, %ddp resize does."""
    k = pool3
    pids = start(k)
    k.ok("from nbddp.kernel.ranks import starters\n_start = starters.ForkStarter.start\n"
         "def no_memory(self, *a):\n    raise OSError(12, 'Cannot allocate memory')\n"
         "starters.ForkStarter.start = no_memory")
    try:
        os.kill(pids[0], signal.SIGKILL)
        assert wait_for(k, f"not {POOL}.losses.pending and {POOL}.gang.world_size == 2", 30)
    finally:
        k.ok("starters.ForkStarter.start = _start")
    res, places = weights_and_places(k)
    assert "could not heal the pool: no new rank 0 could start (OSError: [Errno 12] Cannot allocate memory); it " \
           "shrank instead (%ddp resize 3 grows it back once there is room)" in res.stderr, res.stderr
    assert "(1→0, 2→1)" in res.stderr and [p[:2] for p in places] == [(0, 2), (1, 2)], (res.stderr, places)
    assert pool_pids(k) == pids[1:] and k.value(f"{POOL}.ended is None")
    res = k.ok("%ddp resize 3", timeout=120)
    assert "resized the pool from 2 to 3 ranks" in res.stdout, res.stdout
    weights_and_places(k)


def test_a_second_replacement_that_cannot_start_kills_the_first_at_once_and_the_pool_shrinks(pool3):
    """Two lost; the first replacement starts, the second cannot: the first is killed, not asked to stop (it
    waits to join a group that will never be: STOP_S for nothing), and the one survivor goes on alone."""
    k = pool3
    pids = start(k)
    k.ok("from nbddp.kernel.ranks import starters\n_start = starters.ForkStarter.start\nforks = []\n"
         "def second_fails(self, *a):\n    forks.append(1)\n    if len(forks) == 2:\n"
         "        raise OSError(12, 'Cannot allocate memory')\n    return _start(self, *a)\n"
         "starters.ForkStarter.start = second_fails")
    try:
        os.kill(pids[0], signal.SIGKILL)
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(k, f"not {POOL}.losses.pending and {POOL}.gang.world_size == 1", 30)
    finally:
        k.ok("starters.ForkStarter.start = _start")
    res = k.ok("%%ddp --gather have\nhave = (rank, world_size, 'mine' in globals())\n")
    assert "no new rank 1 could start (OSError: [Errno 12] Cannot allocate memory); it shrank instead" \
        in res.stderr, res.stderr
    assert k.value("have") == [(0, 1, True)] and pool_pids(k) == pids[2:], "the survivor alone, nothing else"
    took = float(re.search(r"shrank the pool in ([\d.]+) s", res.stderr).group(1))
    assert took < 5.0, f"the started replacement was killed at once, not given STOP_S: {took} s"


def test_an_interrupt_while_healing_ends_the_pool_and_leaves_nothing(pool3, tmp_path):
    k = pool3
    pids = start(k)
    mark = tmp_path / "fingerprinting"
    k.ok(f"%%ddp\nimport time\nclass Slow:\n    def __reduce__(self):\n        open({str(mark)!r}, 'w').close()\n"
         "        time.sleep(30)\n        return (int, ())\nslow = Slow()\n")
    os.kill(pids[2], signal.SIGKILL)
    end = time.monotonic() + 20
    while not mark.exists() and time.monotonic() < end:  # the watch is healing: a survivor fingerprints Slow
        time.sleep(0.02)
    assert mark.exists()
    k.interrupt()  # the kernel is idle: the watch listens for Jupyter's interrupt while it heals
    assert wait_for(k, f"{POOL}.ended is not None", 30)
    assert "interrupted while fingerprinting the pool's names" in k.value(f"{POOL}.ended")


def test_a_script_without_an_event_loop_heals_at_the_next_run():
    """nbddp.Pool in a plain process: no loop watches the ranks, the next run() finds the loss and heals."""
    import subprocess
    import sys

    code = ("import os, signal, time, nbddp, torch\n"
            "with nbddp.Pool(devices=3) as pool:\n"
            "    pids = pool.run(os.getpid)\n"
            "    os.kill(pids[1], signal.SIGKILL)\n"
            "    time.sleep(0.5)\n"
            "    print(pool.run(lambda: int(os.environ['RANK'])), pids[1] not in pool.run(os.getpid))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "[0, 1, 2] True" in out.stdout, out.stdout + out.stderr
    assert "healed the pool" in out.stderr, out.stderr


def test_the_loss_and_healing_are_said_in_the_pools_view_with_their_times(pool3):
    k = pool3
    pids = start(k)
    os.kill(pids[1], signal.SIGKILL)
    assert wait_for(k, f"not {POOL}.losses.pending and bool({POOL}.losses.history)")
    lines = k.value(f"{POOL}.view.event_lines()")
    assert len(lines) == 4, lines
    assert "rank 1 lost while idle: killed by SIGKILL" in lines[0] and "healing: rank(s) 1 lost" in lines[1], lines
    assert "healed the pool in" in lines[2] and "lacking: mine (Cell In[" in lines[3], lines
    assert all(line[2] == ":" and line[5] == ":" for line in lines), "each with its time"
    assert said(k.ok("%%ddp\nprint('on', world_size)\n").stdout, 1, "on 3")


def test_a_second_heal_finds_the_first_replacements_names_alike(pool3):
    """The replacement's values were unpickled, not built: their fingerprints must still equal the others'
    (pickle's memo follows object identity; a function's code was rebuilt)."""
    k = pool3
    pids = start(k)
    os.kill(pids[2], signal.SIGKILL)
    assert wait_for(k, f"len({POOL}.losses.history) == 1 and not {POOL}.losses.pending")
    weights_and_places(k)
    os.kill(pool_pids(k)[0], signal.SIGKILL)  # rank 0: the survivors then are rank 1 and the first replacement
    assert wait_for(k, f"len({POOL}.losses.history) == 2 and not {POOL}.losses.pending")
    res, places = weights_and_places(k)
    assert "a new rank 0 took 6 name(s) from rank 1 (DDP, data, model, opt, step, w)" in res.stderr, res.stderr


def test_a_rank_lost_in_a_background_cell_is_mended_between_cells(pool3):
    """No fork beside the notebook's code: a background cell's loss is mended on the notebook's thread."""
    k = pool3
    start(k)
    k.ok("%%ddp --bg\nimport signal, time\nfor i in range(100):\n    if rank == 2 and i == 3:\n"
         "        os.kill(os.getpid(), signal.SIGKILL)\n    step()\n    time.sleep(0.02)\n")
    res = k.run("%ddp wait", timeout=60)
    assert "rank 2 failed: killed by SIGKILL" in res.error_text, res.error_text
    assert "The pool heals itself (heal) before its next cell." in res.error_text, res.error_text
    assert wait_for(k, f"not {POOL}.losses.pending and {POOL}.gang.alive", 30)
    weights_and_places(k)


def test_a_forkserver_pool_heals_and_the_replacement_is_sent_the_notebooks_names(pool3):
    """A forkserver's replacement holds none of the notebook's names: each one a cell reads is sent again."""
    k = pool3
    res = k.ok("%ddp start --devices 3 --start-method forkserver")
    assert "pool of 3 rank(s)" in res.stdout, res.stdout
    k.ok(BUILD)
    pids = pool_pids(k)
    os.kill(pids[2], signal.SIGKILL)
    assert wait_for(k, f"bool({POOL}.losses.history) and not {POOL}.losses.pending", 30)
    res, places = weights_and_places(k)
    assert "healed the pool" in res.stderr and [p[:2] for p in places] == [(0, 3), (1, 3), (2, 3)], res.stderr


def test_fsdp2_shards_are_named_lost_with_the_fix_and_never_copied(pool3):
    """The lost rank's shards went with it: an FSDP2 model and its optimizer are named, with the checkpoint fix."""
    k = pool3
    start(k)
    k.ok("%%ddp\nfrom torch.distributed.fsdp import fully_shard\nsharded = torch.nn.Linear(8, 8)\n"
         "fully_shard(sharded)\nsopt = torch.optim.Adam(sharded.parameters())\n"
         "sopt.zero_grad(); sharded(torch.ones(2, 8)).sum().backward(); sopt.step()\n")
    pids = pool_pids(k)
    os.kill(pids[1], signal.SIGKILL)
    assert wait_for(k, f"bool({POOL}.losses.history) and not {POOL}.losses.pending", 30)
    res, _ = weights_and_places(k)
    for name in ("sharded", "sopt"):
        assert f"  {name} (Cell In[" in res.stderr, res.stderr
    assert "sharded (FSDP2 / DTensor): the lost rank's shards went with it; load the last torch.distributed." \
           "checkpoint (dcp.load, resharded) on every rank" in res.stderr, res.stderr
    res = k.ok("%%ddp --gather has\nhas = 'sharded' in globals()\n")
    assert k.value("has") == [True, False, True]


def test_the_ranks_curves_go_on_across_a_heal(pool3):
    """Item 7 of issue 55: what the ranks log (nbddp.log) goes on in nbddp.metrics() after a heal, the new rank's
    points in the lost rank's curve, in order, each step once."""
    k = pool3
    pids = start(k)
    log = "%%ddp\nimport nbddp\nfor i in range({a}, {b}):\n    nbddp.log(step=i, loss=float(i * 10 + rank))\n"
    k.ok(log.format(a=0, b=3))
    os.kill(pids[2], signal.SIGKILL)
    assert wait_for(k, f"bool({POOL}.losses.history) and not {POOL}.losses.pending")
    k.ok(log.format(a=3, b=6))
    k.ok("import nbddp\nm = nbddp.metrics()\n"
         "curves = {r: list(zip(g['step'], g['loss'])) for r, g in m.groupby('rank')}")
    curves = k.value("{int(r): [(int(s), float(v)) for s, v in c] for r, c in curves.items()}")
    assert curves == {r: [(i, float(i * 10 + r)) for i in range(6)] for r in range(3)}, curves


MESH = ("%%ddp\nfrom torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import distribute_tensor, Replicate, Shard\n"
        "mesh = init_device_mesh('cpu', (world_size,), mesh_dim_names=('dp',))\n"
        "w = distribute_tensor(torch.arange(12.).reshape(6, 2), mesh, [Replicate()])\n"
        "s = distribute_tensor(torch.arange(12.).reshape(6, 2), mesh, [Shard(0)])\n")
ON_THE_MESH = ("%%ddp --gather got\nr = distribute_tensor(torch.full((3,), float(rank + 5)), mesh, [Replicate()])\n"
               "got = (mesh.size(), w.device_mesh is mesh, w.to_local().sum().item(), r.to_local().tolist(), "
               "'s' in globals())\n")


@pytest.mark.parametrize("on_loss", ["heal", "shrink"])
def test_a_device_mesh_and_a_replicated_dtensor_are_made_anew_and_a_shard_is_named(pool3, on_loss):
    """A DeviceMesh and a DTensor every rank holds whole (Replicate) are made anew on the new group, the mesh at the
    group's new size (shrink); a sharded DTensor is named, on the survivors too (still on the old group)."""
    k = pool3
    pids = start(k, on_loss=on_loss)
    k.ok(MESH)
    os.kill(pids[1], signal.SIGKILL)
    assert wait_for(k, f"bool({POOL}.losses.history) and not {POOL}.losses.pending", 30)
    res = k.ok(ON_THE_MESH, timeout=120)
    ws = 3 if on_loss == "heal" else 2
    # a collective on the rebuilt mesh (a broadcast from its rank 0), the replicated values as they were
    assert k.value("got") == [(ws, True, 66.0, [5.0] * 3, on_loss == "shrink" or r != 1) for r in range(ws)]
    assert "mesh (DeviceMesh), w (DTensor)" in res.stderr, res.stderr
    assert "  s (Cell In[" in res.stderr and "sharded (FSDP2 / DTensor)" in res.stderr, res.stderr


def test_a_2d_mesh_that_does_not_fit_the_new_size_is_named_and_a_1d_one_is_made_anew(pool3):
    """A pool of 4 resized to 3: a 1-D mesh (and what is on it) is made anew at 3; a 2-D mesh (2 x 2) cannot be,
    and it and the DTensor on it are named with the fix, not dropped in silence."""
    k = pool3
    k.ok("%ddp start --devices 4")
    k.ok(MESH + "grid = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
         "g = distribute_tensor(torch.ones(4, 4), grid, [Replicate(), Replicate()])\n", timeout=120)
    res = k.ok("%ddp resize 3", timeout=120)
    out = res.stdout + res.stderr
    assert "mesh (DeviceMesh), w (DTensor)" in out, out
    assert re.search(r"  grid \(Cell In\[\d+\].*\): a DeviceMesh of shape \(2, 2\) over ranks \[0, 1, 2, 3\] cannot be "
                     r"made on a group of 3: make it again", out), out
    assert re.search(r"  g \(Cell In\[\d+\].*\): a DeviceMesh of shape \(2, 2\)", out), out
    assert "these names still use the old process group (they could not be made anew on the new one)" in out, out
    k.ok(ON_THE_MESH, timeout=120)
    assert [got[:4] for got in k.value("got")] == [(3, True, 66.0, [5.0] * 3)] * 3


def test_a_mesh_that_does_not_fit_a_grown_pool_is_named_stale_on_every_rank_not_lacking_on_the_new(pool3):
    k = pool3
    k.ok("%ddp start --devices 2")
    k.ok("%%ddp\nfrom torch.distributed.device_mesh import init_device_mesh\n"
         "grid = init_device_mesh('cpu', (1, 2), mesh_dim_names=('dp', 'tp'))\n", timeout=120)
    out = k.ok("%ddp resize 3", timeout=120).stdout
    assert "resized the pool from 2 to 3 ranks" in out and "rank(s) 2 took" in out, out
    assert "still use the old process group" in out and "lack these names" not in out, out
    assert re.search(r"  grid \(Cell In\[\d+\].*\): a DeviceMesh of shape \(1, 2\)", out), out


def test_a_notebook_model_trained_in_place_by_the_pool_reaches_the_replacement(pool3):
    """`net` is the notebook's: the replacement, a fork of the kernel, has the untrained one unless healing
    sees that every survivor changed it alike (and keeps `ddp.module is net`)."""
    k = pool3
    k.ok("net = torch.nn.Linear(4, 1)")
    res = k.ok("%ddp start --devices 3")
    k.ok("%%ddp\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nddp = DDP(net)\n"
         "opt = torch.optim.SGD(ddp.parameters(), lr=0.5)\n"
         "for _ in range(3):\n    opt.zero_grad(); ddp(torch.ones(8, 4)).sum().backward(); opt.step()\n")
    os.kill(pool_pids(k)[2], signal.SIGKILL)
    assert wait_for(k, f"bool({POOL}.losses.history) and not {POOL}.losses.pending", 30)
    res = k.ok("%%ddp --gather w same\nw = net.weight.detach().clone()\nsame = ddp.module is net\n")
    assert "net" in res.stderr.split("took")[1].split("\n")[0], res.stderr
    w = k.value("[t.tolist() for t in w]")
    assert w[0] == w[1] == w[2] and k.value("same") == [True] * 3, w
