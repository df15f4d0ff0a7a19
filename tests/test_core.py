"""The core promise, through a real kernel: %%ddp runs a cell on 2 forked gloo ranks."""
import re

import pytest

pytestmark = pytest.mark.timeout(120)


def test_cell_runs_on_every_rank_with_injected_names(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\n"
        "import torch.distributed as dist\n"
        "t = torch.tensor([rank + 1.0])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank={rank} local={local_rank} world={world_size} device={device} sum={t.item()}')\n"
        "print('env', os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'], "
        "os.environ['MASTER_ADDR'], os.environ['TORCHELASTIC_RUN_ID'] != '', dist.get_backend())\n"
    )
    lines = res.stdout.splitlines()
    assert "[rank0]:rank=0 local=0 world=2 device=cpu sum=3.0" in lines
    assert "[rank1]:rank=1 local=1 world=2 device=cpu sum=3.0" in lines
    assert "[rank0]:env 0 2 2 127.0.0.1 True gloo" in lines
    assert "[rank1]:env 1 2 2 127.0.0.1 True gloo" in lines


def test_one_rank_just_works_as_on_colab(clean_kernel):
    """`--devices auto` on a CPU machine (or a 1-GPU Colab) is a single rank: a group of one."""
    res = clean_kernel.ok("%%ddp\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                          "print(world_size, dist.get_world_size())\n(rank, t.item())\n")
    assert res.stdout == "[rank0]:1 1\n" and res.result == "(0, 1.0)"


def test_ddp_training_matches_full_batch_training_in_the_kernel(clean_kernel):
    k = clean_kernel
    k.ok(
        "torch.manual_seed(0)\n"
        "X = torch.randn(64, 8); Y = X @ torch.randn(8, 1) + 0.1 * torch.randn(64, 1)\n"
        "init = torch.nn.Linear(8, 1).state_dict()\n"
        "ref = torch.nn.Linear(8, 1); ref.load_state_dict(init)\n"
        "opt = torch.optim.SGD(ref.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    opt.zero_grad(); torch.nn.functional.mse_loss(ref(X), Y).backward(); opt.step()\n"
    )
    res = k.ok(
        "%%ddp --devices 2 --out state\n"
        "model = torch.nn.Linear(8, 1); model.load_state_dict(init)\n"
        "ddp = torch.nn.parallel.DistributedDataParallel(model)\n"
        "opt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    opt.zero_grad()\n"
        "    loss = torch.nn.functional.mse_loss(ddp(X[rank::world_size]), Y[rank::world_size])\n"
        "    loss.backward(); opt.step()\n"
        "print(f'loss {loss.item():.4f}')\n"
        "state = model.state_dict()\n"
        "loss.item()\n"
    )
    assert re.search(r"^\[rank0\]:loss \d+\.\d{4}$", res.stdout, re.M)
    assert re.search(r"^\[rank1\]:loss \d+\.\d{4}$", res.stdout, re.M)
    assert float(res.result) > 0
    assert k.value("all(torch.allclose(state[n], ref.state_dict()[n], atol=1e-6) for n in state)") is True
    # equal halves of the batch, averaged by DDP = the full batch's gradient


def test_last_expression_and_outs_and_namespace_untouched(clean_kernel):
    k = clean_kernel
    k.ok("keep = 'kernel'")
    res = k.ok(
        "%%ddp --devices 2 -o a b\n"
        "keep = f'rank{rank}'\n"
        "a = torch.arange(3) * (rank + 1)\n"
        "b = {'rank': rank}\n"
        "scratch = 1\n"
        "rank * 10 + 7\n"
    )
    assert res.result == "7"  # rank 0's value is Out[n]
    assert k.value("a.tolist(), b, keep") == ([0, 1, 2], {"rank": 0}, "kernel")
    assert k.value("[n in globals() for n in ('scratch', 'rank', 'world_size', 'device', 'local_rank')]") == [False] * 5
    assert k.ok("%%ddp --devices 2\n1 + 1;").result is None  # a trailing ';' silences it, as in IPython


def test_notebook_tensor_is_shared_copy_on_write(clean_kernel):
    k = clean_kernel
    k.ok("big = torch.ones(100 * 2**20)  # 400 MB, built once in the notebook")
    res = k.ok(
        "%%ddp --devices 2\n"
        "import psutil\n"
        "total = big[rank::world_size].sum().item()  # every rank reads its half\n"
        "uss = psutil.Process().memory_full_info().uss\n"
        "print(f'rank {rank} read {total:.0f} uss_mb {uss / 2**20:.0f}')\n",  # one line per rank, never merged
        timeout=90,
    )
    usses = [int(m) for m in re.findall(r"uss_mb (\d+)", res.stdout)]
    assert len(usses) == 2, res.stdout
    assert all(u < 150 for u in usses), f"rank USS {usses} MB: the 400 MB tensor was copied"
    assert "read 52428800" in res.stdout
    k.ok("del big")


def test_exception_on_one_rank_fails_the_cell_with_its_traceback(clean_kernel):
    res = clean_kernel.run(
        "%%ddp --devices 2\n"
        "import torch.distributed as dist\n"
        "def step():\n"
        "    if rank == 1:\n"
        "        raise ValueError('bad batch on rank 1')\n"
        "    dist.all_reduce(torch.ones(1))  # rank 0 waits in a collective\n"
        "step()\n",
        timeout=30,
    )
    assert res.error and res.error["ename"] == "RankFailure"
    text = res.error_text
    assert "rank 1 failed: ValueError: bad batch on rank 1" in text
    assert re.search(r"Cell In\[\d+\], line 7", text) and re.search(r"Cell In\[\d+\], line 5", text)
    assert "raise ValueError('bad batch on rank 1')" in text
    assert "nbddp/" not in text.split("Traceback")[1]  # no launcher internals in the user's traceback
    assert res.seconds < 15


def test_syntax_error_launches_nothing(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2\nprint('never'\n")
    assert res.error["ename"] == "UsageError"
    assert "does not compile" in res.error_text and "never" not in res.stdout


def test_twenty_reruns_leave_no_process_fd_or_thread(clean_kernel):
    k = clean_kernel
    cell = "%%ddp --devices 2\nimport torch.distributed as dist\ndist.all_reduce(torch.ones(1)); rank\n"
    k.ok(cell)  # warm up: first-use imports open files of their own
    proc = k.process()
    before = (proc.num_fds(), proc.num_threads(), len(proc.children(recursive=True)))
    for _ in range(20):
        assert k.ok(cell).result == "0"
    after = (proc.num_fds(), proc.num_threads(), len(proc.children(recursive=True)))
    assert all(a <= b for a, b in zip(after, before)), f"(fds, threads, children) before {before} after {after}"
    assert k.value("sorted(k for k in os.environ if k in ('RANK', 'MASTER_PORT', 'WORLD_SIZE'))") == []


def test_run_directory_is_private_and_keeps_logs(clean_kernel, runs_dir):
    import os
    import stat

    clean_kernel.ok("%%ddp --devices 2\nprint('to the log')\n")
    run = max(runs_dir.iterdir(), key=lambda p: p.name)
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    assert not (run / "store").exists()
    log = run / "rank1.log"
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    assert "to the log" in log.read_text()
