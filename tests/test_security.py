"""Nothing of a run listens beyond loopback; its files are private to the user."""
import ipaddress
import json
import os
import stat

import pytest

pytestmark = pytest.mark.timeout(120)

LIST_LISTENERS = """
import psutil, json, socket, torch.distributed as dist
dist.barrier()          # both ranks are up and connected: gloo's sockets exist now
if rank == 0:
    kernel = psutil.Process(os.getppid())
    tree = [kernel, *kernel.children(recursive=True)]
    found = [(p.pid, c.laddr.ip, c.laddr.port) for p in tree
             for c in getattr(p, 'net_connections', getattr(p, 'connections', None))('inet')  # psutil < 6: connections
             if c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM]
    print('LISTEN', json.dumps({'pids': [p.pid for p in tree], 'ranks': len(kernel.children()), 'sockets': found}))
dist.barrier()          # keep rank 1 alive until rank 0 has looked
"""


def test_no_socket_of_a_run_listens_beyond_loopback(clean_kernel):
    res = clean_kernel.ok("%%ddp --devices 2\n" + LIST_LISTENERS)
    line = next(ln for ln in res.stdout.splitlines() if "LISTEN" in ln)
    seen = json.loads(line.split("LISTEN ", 1)[1])
    assert seen["ranks"] == 2 and len(seen["pids"]) >= 3  # kernel, 2 ranks (and each rank's guardian)
    assert seen["sockets"], "expected gloo's listening sockets to be visible"
    exposed = [s for s in seen["sockets"] if not ipaddress.ip_address(s[1]).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_run_directories_and_logs_are_private(clean_kernel, runs_dir):
    clean_kernel.ok("%%ddp --devices 2\nprint('secret', rank)\n")
    assert stat.S_IMODE(os.stat(runs_dir).st_mode) == 0o700
    runs = list(runs_dir.iterdir())
    assert runs
    for run in runs:
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
        for f in run.iterdir():
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_forked_ranks_meet_on_the_kernels_store_over_pipes(clean_kernel, runs_dir):
    """No store file and no store port: the group's keys (its own, and a new_group's) go to the kernel's
    store over each rank's pipes, which answers a wait when the key is set (a FileStore polls every 10 ms)."""
    res = clean_kernel.ok("%%ddp --devices 2\nimport torch, torch.distributed as dist\n"
                          "sub = dist.new_group([0, 1])\nt = torch.ones(1)\ndist.all_reduce(t, group=sub)\n"
                          "store = dist.distributed_c10d._get_default_store()\n"
                          "print('STORE', type(getattr(store, 'underlying_store', store)).__name__, t.item())\n")
    for r in (0, 1):
        assert f"[rank{r}]:STORE PipeStore 2.0" in res.stdout or "[rank0-1]:STORE PipeStore 2.0" in res.stdout, \
            res.stdout
    stores = [f for run in runs_dir.iterdir() for f in run.iterdir() if f.name.startswith("store")]
    assert all(f.stat().st_size == 0 for f in stores), stores  # (spawned ranks' FileStore: unused here)


def test_what_ranks_log_and_their_profiles_stay_private(clean_kernel, runs_dir):
    clean_kernel.ok("%%ddp --devices 2 --profile 2\nimport nbddp\nfor step in range(4):\n    nbddp.log(step=step, "
                    "loss=1.0)\n")
    written = [f for run in runs_dir.iterdir() for f in run.iterdir()
               if f.name == "metrics.csv" or f.name.endswith(".trace.json")]
    assert len(written) >= 3, written  # metrics.csv, rank0.trace.json, rank1.trace.json
    for f in written:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
