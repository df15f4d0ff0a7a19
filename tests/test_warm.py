"""Issue 34, part 1, through real kernels: what a real first step imports lazily is imported once in the
kernel before the fork, so a fresh rank's first DDP + AdamW step imports (almost) nothing; modules a rank
imported are learned for the next fork; NBDDP_WARM=0 turns it off."""
import pytest

from kernel import Kernel

pytestmark = pytest.mark.timeout(240)

# a real first step, measured inside the rank: the modules it imported
FIRST_STEP = """%%ddp --devices 2 --gather new
import sys
before = len(sys.modules)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 8)).sum().backward()
opt.step()
new = len(sys.modules) - before
"""


def test_a_fresh_ranks_first_ddp_step_imports_almost_nothing(clean_kernel):
    k = clean_kernel
    k.ok(FIRST_STEP)  # the fork waited for the warming thread: no rank imports torch._dynamo
    assert all(n <= 25 for n in k.value("new")), k.value("new")
    assert k.value("'torch._dynamo' in sys.modules") is True
    assert k.value("[t.name for t in __import__('threading').enumerate() if t.name == 'nbddp-warm']") == []


def test_a_pools_first_cell_imports_almost_nothing_too(clean_kernel):
    k = clean_kernel
    k.ok("%ddp start --devices 2")
    try:
        k.ok(FIRST_STEP.replace(" --devices 2", ""))
        assert all(n <= 25 for n in k.value("new")), k.value("new")
    finally:
        k.ok("%ddp stop")


def test_what_a_rank_imported_is_learned_for_the_next_fork_but_never_a_new_library(clean_kernel):
    k = clean_kernel
    k.ok("import json, email")  # packages the kernel has; their submodules below it has not
    assert k.value("[m in sys.modules for m in ('json.tool', 'email.mime.text', 'wave')]") == [False] * 3
    k.ok("%%ddp --devices 2\nimport json.tool, email.mime.text, wave")
    k.ok("from nbddp.kernel.ranks import warm\nwarm.wait()")
    assert k.value("[m in sys.modules for m in ('json.tool', 'email.mime.text', 'wave')]") == [True, True, False]
    k.ok("%%ddp --devices 2 --gather fresh\nimport sys\nfresh = 'json.tool' in sys.modules")
    assert k.value("fresh") == [True, True], "the next fork has it from the start"


def test_nbddp_warm_0_turns_it_off(runs_dir):
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir), "NBDDP_WARM": "0"}) as k:
        k.ok("%load_ext nbddp\nimport torch, sys")
        k.ok(FIRST_STEP)
        assert k.value("'torch._dynamo' in sys.modules") is False
        assert all(n > 100 for n in k.value("new")), "without warming, each rank imports DDP's modules itself"


def test_the_notebooks_own_fork_right_after_load_ext_waits_for_the_warming_imports(runs_dir):
    """A fork that is not nbddp's (torch.multiprocessing with fork, as Lightning's ddp_notebook and
    Accelerate's notebook_launcher do) right after %load_ext: before the fix its child hung on a module
    lock the warming thread held (its first all_reduce never came)."""
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok("%load_ext nbddp\nimport os, tempfile, torch, torch.distributed as dist, torch.multiprocessing as mp\n"
             "def job(rank, path):\n    torch.set_num_threads(1)\n"
             "    dist.init_process_group('gloo', init_method=f'file://{path}', rank=rank, world_size=2)\n"
             "    t = torch.ones(1)\n    dist.all_reduce(t)\n    assert t.item() == 2\n    "
             "dist.destroy_process_group()\n"
             "mp.start_processes(job, args=(os.path.join(tempfile.mkdtemp(), 'store'),), nprocs=2, "
             "start_method='fork')\n"
             "print('both ranks done')", timeout=90)
