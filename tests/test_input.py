"""Bad input: one clear message, nothing launched, nothing in the notebook lost."""
import re

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nothing_launched(clean_kernel, runs_dir):
    clean_kernel.ok("sentinel = 'kept'")
    before = set(runs_dir.iterdir())
    yield clean_kernel
    assert set(runs_dir.iterdir()) == before, "a run was started for bad input"
    assert clean_kernel.value("sentinel") == "kept"


@pytest.mark.parametrize(
    "line, ename, message",
    [
        ("--frobnicate", "UsageError", "unrecognized arguments: --frobnicate"),
        ("--devices banana", "UsageError", "--devices 'banana' is not a device spec"),
        ("--devices 1,1", "UsageError", "lists device 1 more than once"),
        ("--devices -4", "UsageError", "need at least one device"),
        ("--devices 0,1 --accelerator cpu", "UsageError", "CPU ranks are counted, not indexed"),
        ("--accelerator cuda", "UsageError", "NVML sees no GPU"),
        ("--backend nccl --devices 2", "UsageError", "--backend nccl needs GPUs"),
        ("--accelerator tpu", "UsageError", "invalid choice: 'tpu'"),
        ("--threads 0 --devices 2", "UsageError", "--threads 0: need a whole number >= 1"),
        ("--timeout -1 --devices 2", "UsageError", "--timeout -1.0: need a number of seconds > 0"),
    ],
)
def test_bad_options(nothing_launched, line, ename, message):
    res = nothing_launched.run(f"%%ddp {line}\nsentinel = 'lost'\n")
    assert res.status == "error", res
    assert ename in res.error_text and message in res.error_text, res.error_text
    assert len(res.error_text.splitlines()) < 25  # one screen


def test_help_is_the_reference(clean_kernel):
    res = clean_kernel.ok("print(get_ipython().find_cell_magic('ddp').__doc__)")
    for option in ("--devices", "--accelerator", "--backend", "--out", "--start-method", "--threads", "--timeout"):
        assert option in res.stdout


def test_out_of_a_name_rank0_never_defined(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2 -o here nowhere\nhere = rank + 5\n")
    assert res.error["ename"] == "ResultError"
    assert "--out nowhere: rank 0 never defined `nowhere`" in res.error_text
    assert "these arrived: here" in res.error_text
    assert clean_kernel.value("here") == 5


def test_nested_ddp_inside_a_rank_is_refused(clean_kernel):
    res = clean_kernel.run(
        "%%ddp --devices 2\nget_ipython().run_cell_magic('ddp', '--devices 2', 'print(1)')\n", timeout=30
    )
    assert res.error["ename"] == "RankFailure"
    assert "UsageError: nbddp cannot launch from inside a rank" in res.error_text


def test_a_second_launch_while_one_runs_is_refused(clean_kernel, tmp_path):
    flag = tmp_path / "refused"
    k = clean_kernel
    k.ok(
        "import threading, nbddp, time, nbddp.kernel.checks as L\n"
        "second = []\n"
        "def try_second():\n"
        "    deadline = time.monotonic() + 30\n"
        "    while not L.launching() and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    try:\n"
        "        nbddp.launch(print, devices=1)\n"
        "    except nbddp.UsageError as e:\n"
        "        second.append(str(e))\n"
        f"    open({str(flag)!r}, 'w').close()\n"
        "threading.Thread(target=try_second).start()\n"
    )
    k.ok(
        "%%ddp --devices 2\nimport time, pathlib\ndeadline = time.monotonic() + 30\n"
        f"while not pathlib.Path({str(flag)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n",
        timeout=60,
    )
    assert "another nbddp launch is still running" in k.value("second[0]")


def ddp_without(k, os_function: str, options: str):
    """Run a %%ddp cell in the kernel while ``os.<os_function>`` is missing (as on another platform)."""
    return k.run(f"import os\n_saved = os.{os_function}\ndel os.{os_function}\ntry:\n"
                 f"    get_ipython().run_cell_magic('ddp', {options!r}, 'sentinel = 1')\n"
                 f"finally:\n    os.{os_function} = _saved\n")


def test_fork_unavailable_says_use_spawn(nothing_launched):
    res = ddp_without(nothing_launched, "fork", "--devices 2")
    assert res.error["ename"] == "UsageError"
    assert re.search(r"fork is not available on linux: use --start-method spawn", res.error_text)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_without_pidfds_exits_are_seen_through_the_life_pipe(clean_kernel, method):
    """macOS has no pidfd_open: the same supervisor then watches a pipe each rank holds open."""
    k = clean_kernel
    k.ok("import os\n_pidfd = os.pidfd_open\ndel os.pidfd_open")
    try:
        ok = k.ok(f"%%ddp --devices 2 --start-method {method}\nimport torch.distributed as dist\n"
                  "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()\n", timeout=90)
        assert ok.result == "2.0"
        bad = k.run(f"%%ddp --devices 2 --start-method {method}\nimport os, signal\nif rank == 1:\n"
                    "    os.kill(os.getpid(), signal.SIGKILL)\nimport torch.distributed as dist\ndist.barrier()\n",
                    timeout=90)
        assert "rank 1 failed: killed by SIGKILL" in bad.error_text
        assert bad.seconds < 15
    finally:
        k.ok("os.pidfd_open = _pidfd")


def test_spawn_ships_the_cell_and_the_globals_it_uses(clean_kernel):
    k = clean_kernel
    k.ok("def double(x):\n    return x * 2\nweights = torch.arange(4.0)\nunused = object()")
    res = k.ok("%%ddp --devices 2 --start-method spawn -o got\nprint('spawned', rank)\ngot = double(weights) + rank\n"
               "got.sum().item()\n", timeout=90)
    assert "[rank1]:spawned 1" in res.stdout
    assert res.result == "12.0"
    assert k.value("got.tolist()") == [0.0, 2.0, 4.0, 6.0]


def test_spawn_names_an_unpicklable_global(nothing_launched):
    k = nothing_launched
    k.ok("import threading\nlk = threading.Lock()")
    res = k.run("%%ddp --devices 2 --start-method spawn\nwith lk:\n    pass\n")
    assert res.error["ename"] == "UsageError"
    assert "the global `lk` (_thread.lock)" in res.error_text and "--start-method fork" in res.error_text


def test_spawn_traceback_points_into_the_cell(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2 --start-method spawn\nx = 1\nif rank == 0:\n    x / 0\n", timeout=90)
    assert "rank 0 failed: ZeroDivisionError" in res.error_text
    assert re.search(r"Cell In\[\d+\], line 4", res.error_text) and "x / 0" in res.error_text


def test_windows_is_told_to_use_wsl(nothing_launched):
    res = ddp_without(nothing_launched, "posix_spawn", "--devices 2 --start-method spawn")
    assert res.error["ename"] == "UsageError"
    assert "has neither fork nor posix_spawn" in res.error_text and "WSL2" in res.error_text
