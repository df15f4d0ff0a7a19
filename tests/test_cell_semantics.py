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
