"""Parts of issue 11 through a real kernel: a line redrawn with \\r, randomness as under torchrun."""
import pytest

from nbddp.relay import latest_redraw

pytestmark = pytest.mark.timeout(120)


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

    k = Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)})
    try:
        k.ok("import sys")
        assert k.value("'torch' in sys.modules") is False
        k.ok("%load_ext nbddp")
        assert k.value("'torch.distributed' in sys.modules") is True
        assert k.value("sys.modules['torch'].cuda.is_initialized()") is False, "never touches CUDA"
        k.ok("kernel_modules = set(sys.modules)")
        res = k.ok("%%ddp --devices 2 --gather imported\nimport sys\n"
                   "imported = sorted(m for m in sys.modules if m not in kernel_modules)\n")
        imported = k.value("imported")
        assert imported == [[], []], f"ranks imported {[len(i) for i in imported]} modules: {imported[0][:10]}"
        assert not res.stderr
    finally:
        k.shutdown()

