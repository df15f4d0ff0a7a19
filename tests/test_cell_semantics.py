"""Issue 11 through a real kernel: a %%ddp cell behaves like a notebook cell (a line redrawn with \\r,
randomness as under torchrun, top-level await, help, magics, tracebacks a user can read)."""
import re

import pytest

from kernel import said
from nbddp.views.relay import latest_redraw

pytestmark = pytest.mark.timeout(120)


@pytest.mark.unit
def test_latest_redraw_wherever_the_carriage_returns_sit():
    assert latest_redraw(b"step 0/20\r") == b"step 0/20\r"  # print(..., end="\r")
    assert latest_redraw(b"\rstep 1/20\rstep 2/20\r") == b"step 2/20\r"
    assert latest_redraw(b"\r 10%|##") == b" 10%|##"  # tqdm writes the \r first


def test_print_end_carriage_return_shows_the_latest_state(clean_kernel):
    res = clean_kernel.ok("%%ddp --devices 2 --ranks-output 0\nfor i in range(20):\n"
                          "    print(f'step {i}/20', end='\\r', flush=True)\nprint()\n")
    assert res.stdout == "[rank0]:step 19/20\n", repr(res.stdout)


def test_ranks_draw_different_numbers_on_every_run_and_the_notebook_is_untouched(clean_kernel):
    k = clean_kernel
    k.ok("import random\ntorch.manual_seed(0)\nstate = torch.get_rng_state()")
    cell = "%%ddp --devices 2 --gather r{}\nimport random\nr{} = (torch.rand(2).tolist(), random.random())\n"
    k.ok(cell.format(1, 1))
    k.ok(cell.format(2, 2))
    r1, r2 = k.value("r1"), k.value("r2")
    assert r1[0] != r1[1], "ranks differ, as torchrun's fresh processes do"
    assert r1 != r2, "every run starts from fresh entropy"
    assert k.value("torch.equal(state, torch.get_rng_state())") is True


def test_seed_reproduces_every_ranks_numbers_and_ranks_still_differ(clean_kernel):
    k = clean_kernel
    cell = "%%ddp --devices 2 --seed 7 --gather s{}\ns{} = torch.rand(3).tolist()\n"
    k.ok(cell.format(1, 1))
    k.ok(cell.format(2, 2))
    s1, s2 = k.value("s1"), k.value("s2")
    assert s1 == s2 and s1[0] != s1[1]


def test_load_ext_imports_torch_once_so_ranks_import_nothing(runs_dir):
    """Warm start: a notebook that never imported torch pays for it once, at %load_ext, not per rank per cell."""
    from kernel import Kernel

    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok("import sys")
        assert k.value("'torch' in sys.modules") is False
        k.ok("%load_ext nbddp")
        assert k.value("'torch.distributed' in sys.modules") is True
        assert k.value("sys.modules['torch'].cuda.is_initialized()") is False, "never touches CUDA"
        # what the kernel has when it forks: %load_ext's warming thread (kernel/ranks/warm.py) has finished by then
        k.ok("from nbddp.kernel.ranks import warm\nwarm.wait()\nkernel_modules = set(sys.modules)")
        res = k.ok("%%ddp --devices 2 --gather imported\nimport sys\n"
                   "imported = sorted(m for m in sys.modules if m not in kernel_modules)\n")
        imported = k.value("imported")
        assert imported == [[], []], f"ranks imported {[len(i) for i in imported]} modules: {imported[0][:10]}"
        assert not res.stderr


# -- a %%ddp cell behaves like a notebook cell: await, help, magics, readable tracebacks ------------------
@pytest.fixture(params=["one-shot", "pool"])
def ddp(request, clean_kernel):
    """(kernel, the %%ddp line): a one-shot cell on 2 ranks, or a cell in a 2-rank pool (stopped after)."""
    k = clean_kernel
    if request.param == "one-shot":
        yield k, "%%ddp --devices 2"
        return
    k.ok("%ddp start --devices 2")
    try:
        yield k, "%%ddp"
    finally:
        k.ok("%ddp stop")


def test_top_level_await_runs_in_every_rank(ddp):
    k, head = ddp
    res = k.ok(head + " --gather x\nimport asyncio\nasync def twice(v):\n    await asyncio.sleep(0.01)\n"
               "    return 2 * v\nawait asyncio.sleep(0.01)\nx = await twice(rank)\nawait twice(x + 1)\n")
    assert k.value("x") == [0, 2] and res.result == "2"  # rank 0's last expression, awaited


def test_an_error_after_an_await_points_into_the_cell_without_asyncio_frames(ddp):
    k, head = ddp
    res = k.run(head + "\nimport asyncio\nawait asyncio.sleep(0)\n1 / 0\n", timeout=30)
    text = res.error_text
    assert re.search(r"Cell In\[\d+\], line 4, in <module>\n    1 / 0", text), text
    assert "asyncio" not in text and "nbddp/" not in text, text


def test_help_appears_in_the_cell_from_every_rank(ddp):
    k, head = ddp

    def plain(code):
        return re.sub(r"\x1b\[[0-9;]*m", "", k.ok(code).stdout)  # IPython colours its help

    define = "\ndef helper(a, b=2):\n    'Adds things up.'\n    return a + b\n"
    out = plain(head + define + "helper?\n")
    for r in (0, 1):
        assert said(out, r, "Signature: helper(a, b=2)") and said(out, r, "Docstring: Adds things up."), out
    source = plain(head + " --ranks-output 0" + define + "helper??\n")
    assert "[rank0]:    return a + b" in source and "rank1" not in source, source
    assert said(plain(head + define + "%pinfo helper\n"), 0, "Docstring: Adds things up.")


def test_line_magics_and_shell_commands_still_work_in_ranks(ddp):
    k, head = ddp
    res = k.ok(head + "\n%time t = rank + 1\n%timeit -n1 -r1 u = t\n!echo shell says hi\nprint('t', t)\n")
    for r in (0, 1):
        label = rf"\[rank({r}|0-1)\]:"  # its own line, or one it printed alike with the other rank
        assert re.search(label + "Wall time:", res.stdout) and said(res.stdout, r, "shell says hi"), res.stdout
        assert re.search(label + r".* per loop \(mean ± std. dev. of 1 run, 1 loop each\)", res.stdout)
        assert f"[rank{r}]:t {r + 1}" in res.stdout


def test_frames_in_earlier_cells_are_labelled_as_ipython_does(ddp):
    k, head = ddp
    n = k.value("len(In)")  # In[0] is empty: the next cell is In[n]
    k.ok("def scale(v):\n    return v / 0\n")
    text = k.run(head + "\nscale(rank)\n", timeout=30).error_text
    assert f"Cell In[{n}], line 2, in scale\n    return v / 0" in text, text
    assert "ipykernel_" not in text, text


def test_a_syntax_error_shows_the_line_and_the_caret_and_launches_nothing(ddp):
    k, head = ddp
    res = k.run(head + "\nx = 1\nx = (1,\nprint('never')\n")
    assert res.error["ename"] == "UsageError" and "never" not in res.stdout
    assert re.search(r"does not compile, so nothing was launched:\n  Cell In\[\d+\], line 3\n    x = \(1,\n"
                     r"        \^\nSyntaxError: '\(' was never closed", res.error_text), res.error_text


def test_an_interrupt_says_where_each_rank_was_without_nbddp_frames(ddp):
    k, head = ddp
    res = k.interrupt_when(head + "\nimport time\ndef wait_here():\n    time.sleep(60)\n"
                           "print('up', flush=True)\nwait_here()\n", "up", 2)
    assert res.error["ename"] == "KeyboardInterrupt", res
    text = res.error_text
    assert "interrupted while rank(s) 0-1 ran the cell" in text, text
    assert re.search(r"ranks 0-1 were at Cell In\[\d+\], line 4, in wait_here: time.sleep\(60\)", text), text
    assert "nbddp/" not in text and "selectors" not in text, text
    nxt = k.ok(head + "\nprint('next')\n").stdout
    assert said(nxt, 0, "next") and said(nxt, 1, "next"), nxt


def test_a_ranks_own_keyboard_interrupt_shows_only_the_users_frames(clean_kernel):
    """In a pool, the kernel's interrupt reaches a rank's cell as SIGUSR2 (poolrank's handler raises it)."""
    k = clean_kernel
    k.ok("%ddp start --devices 2")
    try:
        res = k.run("%%ddp\nimport signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGUSR2)\n", timeout=30)
        text = res.error_text
        assert "rank 1 failed: KeyboardInterrupt" in text, text
        # (Python >= 3.13 also marks the whole line with carets)
        assert re.search(r"Cell In\[\d+\], line 4, in <module>\n    os.kill\(.*\)\n(?: +[~^]+\n)?KeyboardInterrupt",
                         text), text
        assert "nbddp/" not in text, text
    finally:
        k.ok("%ddp stop")


def test_timeout_shows_each_stack_once_trimmed_to_the_users_frames(ddp):
    k, head = ddp
    res = k.run(head + " --timeout 2\nimport time\ndef stuck_here():\n    while True:\n        time.sleep(0.05)\n"
                "stuck_here()\n", timeout=60)
    text = res.error_text
    assert "--timeout 2s expired" in text
    # both ranks stuck at the same place: shown once, for both
    assert re.search(r"ranks 0-1 were here:\n  Cell In\[\d+\], line 5 in stuck_here\n    time.sleep\(0.05\)\n"
                     r"  Cell In\[\d+\], line 6 in <module>\n    stuck_here\(\)\n"
                     r"  \(most recent call first; every thread's whole stack is in .*rankN.log\)", text), text
    assert "nbddp/" not in text and "threading.py" not in text and "ipykernel" not in text, text
    assert "Thread 0x" not in res.stderr and "stuck_here" not in res.stderr, "the stacks are shown once"


def test_a_timeout_while_a_cell_awaits_says_so(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2 --timeout 2\nimport asyncio\nawait asyncio.sleep(60)\n", timeout=60)
    text = res.error_text
    assert text.count("(waiting in an `await` of the cell: a coroutine's frames are not on the stack while it "
                      "waits;") == 1 and "ranks 0-1 were here:" in text, text


@pytest.mark.parametrize("code", ["%%ddp --devices 2\n", "%%ddp --devices 2", "%%ddp\n\n   \n"])
def test_an_empty_cell_fails_as_the_other_usage_errors_do(clean_kernel, code):
    res = clean_kernel.run(code, timeout=30)
    assert res.status == "error" and res.error is not None and res.error["ename"] == "UsageError", \
        (res.status, res.stderr)
    assert "%%ddp: the cell is empty" in res.error_text and "nothing ran" in res.error_text, res.error_text
    assert "%ddp start" in res.error_text and res.stderr == "", res.stderr  # not IPython's printed UsageError


def test_a_name_the_cell_never_bound_is_said_with_the_close_names_not_unsendable_advice(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2 --out losss --gather part\nlosses = [rank]\nloss = 1.0\n"
                           "if rank == 0:\n    part = 1\n", timeout=60)
    text = res.error_text
    assert res.error["ename"] == "ResultError", text
    assert ("--out losss: rank 0 never defined `losss`: the cell never assigns it (it assigns loss, losses, part)"
            in text)
    assert "Did you mean `losses` or `loss`?" in text, text  # closest first
    assert "--gather part: rank 1 never defined `part`: the cell assigns it, but not on rank 1" in text, text
    assert "Assign `part` on every rank" in text, text
    assert "Send plain data" not in text, text  # that advice is for values that cannot travel
