"""The forkserver (a kernel that holds CUDA still starts GPU ranks, no restart) and notebook tensors and arrays
reaching ranks through shared memory, in real kernels: one-shot and pool cells, the template forked at
%load_ext and the fresh interpreter, the stand-in CUDA driver (its cuInit fails in a fork of the process that
initialised it), memory per rank, the in-place rules, a 64 MB /dev/shm, a 1,024 open-file limit, SIGKILL."""
import json
import os
import re
import signal
import sys

import psutil
import pytest

from helpers import FORKSERVER, fake_nvml_in_kernel, left_behind, pool_pids
from kernel import Kernel, said
from standin_driver import build

pytestmark = pytest.mark.timeout(240)

MiB = 2**20
PRIVATE = """
from nbddp.hw.procmem import uss_of
def private():  # this process's private memory (USS), as the dashboard reads it
    return uss_of(os.getpid())
"""


def forkserver_pid(k) -> int | None:
    found = [p.pid for p in k.process().children() if p.name() == FORKSERVER]
    return found[0] if found else None


@pytest.fixture
def kernels(runs_dir):
    """Fresh kernels (``start(env=..., before_load=...)``), nbddp loaded; nothing may be left running but
    their forkserver, and after shutdown nothing at all."""
    made = []

    def start(env=None, before_load=""):
        k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir), **(env or {})})
        made.append(k)
        if before_load:
            k.ok(before_load)
        k.ok("%load_ext nbddp\nimport torch, os, sys, numpy as np\n" + PRIVATE)
        return k

    yield start
    for k in made:
        left = left_behind(k)
        everything = k.process().children(recursive=True)
        k.shutdown()
        assert not left, f"ranks left behind: {[(p.pid, p.name()) for p in left]}"
        gone, alive = psutil.wait_procs(everything, timeout=10)
        assert not alive, f"processes outlived their kernel: {alive}"


def test_a_forkserver_cell_reads_notebook_values_and_tensors_through_shared_memory(kernels):
    k = kernels()
    k.ok("X = torch.arange(64 * 2**20, dtype=torch.float32)  # 256 MiB\n"
         "A = np.ones((1024, 1024))  # 8 MiB\nlr = 0.5\ndef scaled(v):\n    return v * lr\n")
    res = k.ok("%%ddp --devices 2 --start-method forkserver\n"
               "import torch.distributed as dist\n"
               "base = private()\n"
               "total = float(X.sum()) + float(A.sum())\n"
               "print('ppid is kernel', os.getppid() == KERNEL, 'scaled', scaled(2), 'total', total)\n"
               "print('private MiB', (private() - base) // 2**20)\n"
               "if rank == 1:\n    X[0] = -7.0; A[0, 0] = -7\n"
               "dist.barrier()\n"
               "print('sees', float(X[0]), float(A[0, 0]))\n".replace("KERNEL", str(k.pid)), timeout=120)
    out = res.stdout
    total = k.value("float(X.sum()) + float(A.sum())")
    for r in (0, 1):
        assert said(out, r, f"ppid is kernel False scaled 1.0 total {total}"), out
    grew = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "private MiB" in line]
    assert grew and all(g < 64 for g in grew), out  # 256 MiB read on every rank: shared, not copied
    assert said(out, 0, "sees 0.0 1.0") and said(out, 1, "sees -7.0 -7.0"), out  # a rank's write is its own
    assert k.value("float(X[0]), float(A[0, 0])") == (0.0, 1.0)  # and never the notebook's
    assert forkserver_pid(k) is not None


def test_the_template_forked_at_load_and_a_fresh_server_see_the_kernel_as_it_is_at_the_cell(kernels, tmp_path):
    for how in ("template", "fresh"):
        k = kernels(env={"NBDDP_FORKSERVER": how})
        assert (forkserver_pid(k) is not None) == (how == "template")  # the template is made at %load_ext
        mod = tmp_path / how / f"mymod_{how}.py"
        mod.parent.mkdir()
        mod.write_text("VALUE = 41\n")
        k.ok(f"sys.path.insert(0, {str(mod.parent)!r})\nimport mymod_{how}\nos.chdir({str(tmp_path)!r})\n"
             "os.environ['NBDDP_TEST_SETTING'] = 'yes'\n")
        res = k.ok(f"%%ddp --devices 2 --start-method forkserver\n"
                   f"print('ahead', 'mymod_{how}' in sys.modules, 'cwd', os.getcwd() == {str(tmp_path)!r}, "
                   f"'env', os.environ.get('NBDDP_TEST_SETTING'), 'value', mymod_{how}.VALUE + 1)\n", timeout=120)
        assert said(res.stdout, 1, "ahead True cwd True env yes value 42"), res.stdout + res.stderr


def test_a_forkserver_pool_keeps_state_and_sees_the_notebooks_in_place_changes(kernels):
    k = kernels()
    k.ok("%ddp start --devices 2 --start-method forkserver", timeout=120)
    pids = pool_pids(k)
    assert len(pids) == 2 and all(psutil.Process(p).ppid() == forkserver_pid(k) for p in pids)
    k.ok("W = torch.zeros(2**20)  # 4 MiB, made after the start\nstep = 3\n")
    res = k.ok("%%ddp\nkept = float(W.sum()) + step\nprint('kept', kept)\nW[0] = 100.0  # the rank's own\n")
    assert said(res.stdout, 0, "kept 3.0"), res.stdout
    assert "W (torch.Tensor, 4.0 MiB in shared memory)" in res.stdout + res.stderr, res.stdout + res.stderr
    res = k.ok("%%ddp\nprint('again', kept, float(W[0]))\n")
    assert said(res.stdout, 1, "again 3.0 100.0"), res.stdout  # not sent again: the rank's own write stays
    k.ok("W.add_(1)  # in place, in the notebook: its version counter moves\n")
    res = k.ok("%%ddp\nprint('after', float(W.sum()))\n")
    assert said(res.stdout, 0, f"after {float(2**20)}"), res.stdout
    k.ok("%ddp stop")


def test_a_fork_pool_reads_a_tensor_made_after_start_shared_and_never_stale(kernels):
    k = kernels()
    k.ok("%ddp start --devices 2")
    k.ok("X = torch.ones(64 * 2**20)  # 256 MiB, made after %ddp start\n")
    res = k.ok("%%ddp\nbase = private()\nprint('sum', float(X.sum()), 'MiB', (private() - base) // 2**20)\n",
               timeout=120)
    grew = [int(line.rsplit(" ", 1)[1]) for line in res.stdout.splitlines() if " MiB " in line]
    assert len(grew) in (1, 2) and all(g < 64 for g in grew), res.stdout  # was +256 MiB per rank (a pickle each)
    assert said(res.stdout, 1, f"sum {float(64 * 2**20)} MiB", start=True), res.stdout
    res = k.ok("%%ddp\nx = float(X[0])\n")  # unchanged: nothing copied or sent again
    assert "sent" not in res.stderr, res.stderr
    k.ok("X.mul_(2)\n")
    res = k.ok("%%ddp\nprint('doubled', float(X[0]))\n")
    assert said(res.stdout, 0, "doubled 2.0"), res.stdout  # before: the old values, and nothing said
    k.ok("%ddp stop")


def test_ten_thousand_tensors_under_a_1024_open_file_limit(kernels):
    k = kernels()
    k.ok("import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))\n"
         "ts = [torch.full((16384,), float(i)) for i in range(10000)]  # 64 KiB each: each through shared memory\n"
         "small = [torch.full((4,), float(i)) for i in range(10000)]\n")
    res = k.ok("%%ddp --devices 2 --start-method forkserver\n"
               "ok = all(float(t[5]) == i for i, t in enumerate(ts)) and sum(float(t[0]) for t in small) == 49995000\n"
               "print('ok', ok, 'fds', len(os.listdir('/proc/self/fd')) < 64)\n", timeout=180)
    assert said(res.stdout, 1, "ok True fds True"), res.stdout + res.stderr
    assert k.value("len(os.listdir('/proc/self/fd'))") < 900


def test_gpu_ranks_from_a_kernel_that_holds_cuda_start_from_the_forkserver(kernels, tmp_path):
    standin = build(tmp_path / "standin")
    # ranks here are CPU processes standing in for GPU ranks: the seam's device calls become CPU ones
    seam = ("import nbddp.hw.cuda as seam, torch\nseam.Cuda.set_device = lambda self, i: torch.device('cpu')\n"
            "seam.Cuda.synchronize = lambda self: None\n")
    k = kernels(env={**standin.env(), "NBDDP_FORKSERVER": "template"}, before_load=seam)
    k.ok(fake_nvml_in_kernel(2) + "guard = nbddp.hw.cuda.backend()\nguard.built = lambda: True\n")
    k.ok("import gpulib_ctypes  # initialises CUDA in the kernel\n")
    cuinit = "import ctypes\nprint('cuInit', ctypes.CDLL(os.environ['STANDIN_DRIVER']).cuInit(0))\n"
    res = k.run("%%ddp --devices 2 --accelerator cpu\n" + cuinit)  # a fork of this kernel: cuInit fails there
    assert said(res.stdout, 0, "cuInit 3"), res.stdout
    res = k.run("%%ddp --devices 2 --backend gloo\n" + cuinit, timeout=120)
    text = res.stdout + res.stderr
    assert not res.error, res.error_text
    assert "CUDA was initialised in this kernel by In [" in text and "import gpulib_ctypes" in text, text
    assert "the ranks start from nbddp's forkserver instead" in text, text
    assert said(res.stdout, 0, "cuInit 0") and said(res.stdout, 1, "cuInit 0"), text
    k.ok("%ddp start --devices 2 --backend gloo", timeout=120)
    k.ok("Y = torch.full((2**18,), 2.0)\n")
    res = k.ok("%%ddp\n" + cuinit + "print('Y', float(Y.sum()))\n")
    assert said(res.stdout, 1, "cuInit 0") and said(res.stdout, 1, f"Y {2.0 * 2**18}"), res.stdout
    k.ok("%ddp stop")


def test_a_package_that_initialises_cuda_on_import_is_never_imported_ahead(kernels, tmp_path):
    standin = build(tmp_path / "standin")
    # imported before %load_ext: nbddp cannot name it, so the server finds out itself, and starts anew without it
    k = kernels(env=standin.env(), before_load="import gpulib_ctypes")
    res = k.ok("%%ddp --devices 2 --start-method forkserver\nimport ctypes\n"
               "print('cuInit', ctypes.CDLL(os.environ['STANDIN_DRIVER']).cuInit(0), 'gpulib_ctypes' in sys.modules)\n",
               timeout=180)
    assert said(res.stdout, 0, "cuInit 0 False"), res.stdout + res.stderr


@pytest.mark.serial  # the whole machine's /dev/shm, or its pids
def test_killing_the_kernel_leaves_no_forkserver_no_rank_and_nothing_in_dev_shm(runs_dir):
    shm_before = set(os.listdir("/dev/shm"))
    k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir), "NBDDP_FORKSERVER": "template"})
    try:
        k.ok("%load_ext nbddp\nimport torch\nX = torch.ones(2**20)\n")
        k.ok("%ddp start --devices 2 --start-method forkserver", timeout=120)
        k.ok("%%ddp\ny = float(X.sum())\n")
        everything = k.process().children(recursive=True)
        assert len(everything) >= 3
        os.kill(k.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(everything, timeout=15)
        assert not alive, f"outlived the kernel: {[(p.pid, p.name()) for p in alive]}"
        assert set(os.listdir("/dev/shm")) <= shm_before
    finally:
        k.shutdown()


def _small_shm_kernelspec(root) -> str:
    spec = root / "kernels" / "nbddp-small-shm"
    spec.mkdir(parents=True)
    inner = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -m ipykernel_launcher -f \"$0\""
    (spec / "kernel.json").write_text(json.dumps({"argv": ["unshare", "-m", "sh", "-c", inner, "{connection_file}"],
                                                  "display_name": "small shm", "language": "python"}))
    return str(root)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"), reason="needs root and unshare")
def test_a_kernel_with_dockers_64_mb_dev_shm_shares_a_256_mib_tensor(runs_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", _small_shm_kernelspec(tmp_path))
    k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}, kernel_name="nbddp-small-shm")
    try:
        k.ok("import os, shutil\nassert shutil.disk_usage('/dev/shm').total <= 64 * 2**20\n%load_ext nbddp\nimport "
             "torch\n")
        k.ok("%ddp start --devices 2")
        k.ok("X = torch.ones(64 * 2**20)  # 256 MiB: four times /dev/shm\n")
        res = k.ok("%%ddp\nprint('sum', float(X.sum()))\n", timeout=120)
        assert said(res.stdout, 1, f"sum {float(64 * 2**20)}"), res.stdout + res.stderr
        k.ok("%ddp stop")
    finally:
        k.shutdown()


def test_memory_that_runs_out_is_a_clear_error_and_nothing_runs(kernels):
    k = kernels()
    k.ok("import nbddp.wire.sharedtensor as st, errno\n"
         "def full(*a):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
         "st.os.posix_fallocate, real = full, st.os.posix_fallocate\n"
         "X = torch.ones(2**20)\n")
    res = k.run("%%ddp --devices 2 --start-method forkserver\nprint('must not run', X.sum())\n")
    text = res.error_text
    assert "`X` (torch.Tensor) must reach the ranks through shared memory" in text and "Nothing ran" in text, text
    assert "del what you no longer need" in text and "must not run" not in res.stdout
    k.ok("st.os.posix_fallocate = real")


def test_a_background_forkserver_pool_cell_runs_beside_notebook_cells_and_ddp_interrupt_keeps_the_pool(kernels):
    k = kernels()
    k.ok("%ddp start --devices 2 --start-method forkserver", timeout=120)
    k.ok("%%ddp\nkept = 10 + rank\n")
    msg_id = k.execute("%%ddp --bg\nimport time\nfor i in range(2000):\n    time.sleep(0.02)\n")
    assert k.collect(msg_id, timeout=30).status == "ok"  # the notebook is free at once
    assert k.ok("6 * 7").result == "42"
    res = k.ok("%ddp interrupt", timeout=60)
    assert "interrupting background cell" in res.stderr, res.stderr
    later = k.follow(msg_id, lambda r: r.error is not None, timeout=60)
    assert later.error["ename"] == "KeyboardInterrupt", later
    assert k.ok("%%ddp --gather kept\nkept").error is None and k.value("kept") == [10, 11]
    k.ok("%ddp stop")


def test_interrupting_a_forkserver_cell_says_where_every_rank_was_and_the_server_lives_on(kernels):
    k = kernels()
    res = k.interrupt_when("%%ddp --devices 2 --start-method forkserver\nimport time\nprint('started', flush=True)\n"
                           "time.sleep(300)\n", "started", 2, timeout=120)
    assert res.error and res.error["ename"] == "KeyboardInterrupt", res
    assert re.search(r"were at Cell In\[\d+\], line 4", res.error_text), res.error_text
    server = forkserver_pid(k)
    assert server is not None and not psutil.Process(server).children()  # its ranks are gone, it is not
    res = k.ok("%%ddp --devices 2 --start-method forkserver\nprint('again', os.getppid())\n")
    assert said(res.stdout, 1, f"again {server}"), res.stdout


# -- the kernel's GPU tensors by CUDA IPC: the seam's code paths with stand-ins (a GPU proves the rest) ----------
class _OnGpu:
    """What a rank opens from an IPC handle, standing in for a CUDA tensor: records how it was copied."""

    def __init__(self):
        self.calls = []
        self.requires_grad = False

    def detach(self):
        return self

    def requires_grad_(self, flag):
        self.calls.append(f"requires_grad {flag}")
        return self

    def clone(self):
        self.calls.append("clone")
        return self

    def to(self, device):
        self.calls.append(f"to {device}")
        return self


@pytest.mark.unit
def test_a_kernel_gpu_tensor_is_handed_by_cuda_ipc_and_copied_device_to_device_in_the_rank(monkeypatch):
    import torch
    import torch.multiprocessing.reductions as reductions

    from nbddp.hw import cuda
    from nbddp.kernel.names import sending
    from nbddp.wire import sharedtensor

    class FakeCuda(torch.Tensor):  # a CPU tensor that says it is on cuda:0
        @property
        def device(self):
            return torch.device("cuda", 0)

    opened = _OnGpu()
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (lambda handle: opened, ("handle",)))
    monkeypatch.setattr(sharedtensor, "gpu_share", cuda.ipc_share)
    G = torch.ones(2**16).as_subclass(FakeCuda)
    ns = {"G": G, "lr": 0.1}
    blobs = sending.ship_globals("print(G, lr)\n", "<cell>", ns, gpu_ipc=True)
    assert blobs.on_gpu == {"G": 2**18} and "G" not in blobs.shared
    notes = sending.shipped_notes(blobs, ns)
    assert notes[0].startswith("sent G (") and notes[0].endswith("FakeCuda, 256 KiB by CUDA IPC) to every rank"), notes
    assert "one more CUDA context on that GPU" in notes[-1]
    with sharedtensor.handing_gpu(False):
        assert sharedtensor.reduce(G) is None  # a fork pool's or CPU ranks': its CPU copy, pickled
    # in the rank: the same GPU copies within it, another GPU reads it from there
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert cuda.opened_on_rank(lambda h: opened, ("handle",), 0).calls == ["clone", "requires_grad False"]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert cuda.opened_on_rank(lambda h: opened, ("handle",), 0).calls[-2] == "to cuda:1"


@pytest.mark.unit
def test_a_parameter_handed_by_cuda_ipc_stays_a_leaf_parameter_an_optimizer_can_take(monkeypatch):
    """A kernel model's parameters reach a forkserver rank as parameters: leaves an optimizer accepts (a bare
    clone of one is a tensor inside an autograd graph). Caught on an H200: the model trained in the rank."""
    import torch

    from nbddp.hw import cuda

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    weight = torch.nn.Parameter(torch.ones(4))
    got = cuda.opened_on_rank(lambda: weight, (), 0)
    assert type(got) is torch.nn.Parameter and got.is_leaf and got.requires_grad and got is not weight
    torch.optim.SGD([got], lr=0.1)  # (raises for a non-leaf)
    frozen = cuda.opened_on_rank(lambda: torch.ones(2, requires_grad=False), (), 0)
    assert not frozen.requires_grad
    tagged = cuda.opened_on_rank(lambda: weight, (), 0, {"_is_hf_initialized": True})
    assert type(tagged) is torch.nn.Parameter and tagged._is_hf_initialized is True, "its attributes came with it"


@pytest.mark.unit
def test_without_cuda_ipc_a_kernel_gpu_tensor_travels_as_its_cpu_copy(monkeypatch):
    import torch.multiprocessing.reductions as reductions

    from nbddp.hw import cuda

    def no_ipc(t):
        raise RuntimeError("CUDA IPC is not supported on this platform (WSL2)")

    monkeypatch.setattr(reductions, "reduce_tensor", no_ipc)
    assert cuda.ipc_share(object()) is None


def _number_taken_by_another(pid: int, leader: bool):
    """A process that now has the number ``pid`` had (made so through ns_last_pid), which says "hit" for each
    SIGUSR2 and ends at SIGTERM, leading a group of that number (``leader``) or not; None where that cannot be
    done here (not root, a busy machine took the number)."""
    import subprocess

    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
    except OSError:
        return None
    taker = subprocess.Popen([sys.executable, "-c", TAKER], stdout=subprocess.PIPE, text=True,
                             start_new_session=leader)
    if taker.pid == pid and taker.stdout.readline() == "ready\n":
        return taker
    taker.kill()
    taker.communicate()
    return None


TAKER = """import signal, sys
signal.signal(signal.SIGUSR2, lambda *_: print("hit", flush=True))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (Python runs handlers in signal order: USR2's first)
print("ready", flush=True)
while True:
    signal.pause()
"""


@pytest.mark.serial  # the whole machine's /dev/shm, or its pids
@pytest.mark.timeout(60)
@pytest.mark.parametrize("leader", [False, True], ids=["another-process", "another-group-leader"])
def test_a_rank_that_ended_is_never_signalled_by_its_number_once_another_process_took_it(leader):
    """A forkserver's rank is reaped by the server, maybe before the kernel handled its end: its number, and its
    group's, are free again. The kernel asks the pidfd the server opened as it forked it (sent with ``Forked``)
    whether the rank is still there first, and signals it by that pidfd: the process that took the number, even
    one leading a group of it, is never reached; by the number (killpg, then kill), it was."""
    from nbddp.kernel.ranks.supervisor import RankProc

    for _ in range(5):
        pid = os.fork()
        if pid == 0:  # the rank, ended at once
            os._exit(0)
        pidfd = os.pidfd_open(pid)  # (the server opens it before it can reap)
        os.waitpid(pid, 0)  # the server reaped it
        taker = _number_taken_by_another(pid, leader)
        if taker is not None:
            break
        os.close(pidfd)
    else:
        pytest.skip("no process could be given a reaped rank's number here (ns_last_pid not writable, or raced)")
    try:
        rank = RankProc(0, pid, pidfd)
        rank.signal(signal.SIGUSR2)  # (its group, then itself)
        rank.signal(signal.SIGUSR2, group=False)
        taker.terminate()
        said, _ = taker.communicate(timeout=30)
        assert "hit" not in said, "the process that took the ended rank's number was signalled"
    finally:
        taker.kill()
        taker.wait()
        os.close(pidfd)
