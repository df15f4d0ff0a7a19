"""Step into a rank (issue 19): input() and pdb in a rank read the notebook's input box (answered here
as JupyterLab answers input_request messages), post-mortem into the failed rank, cells on some ranks of a
pool, %ddp who and %ddp diff. Real kernel, real forks, real gloo."""
import time

import pytest

from kernel import said

pytestmark = pytest.mark.timeout(300)


def pdb_prompts(prompts, rank):
    """How many of ``prompts`` were the debugger's, on ``rank`` (pdb's, or IPython's ipdb: breakpoint()
    in a kernel opens IPython's debugger, as in a plain cell)."""
    assert all(p in (f"[rank{rank}] (Pdb) ", f"[rank{rank}] ipdb> ") for p in prompts), prompts
    return len(prompts)


def answers(*lines):
    """A front end that types ``lines`` in order into the input box."""
    left = list(lines)
    return lambda prompt: left.pop(0)


def test_input_on_a_rank_asks_the_notebook_labelled_with_the_rank(clean_kernel):
    res = clean_kernel.converse("%%ddp --devices 2\nname = input(f'name for rank {rank}? ')\nprint('got', name)\n",
                                lambda prompt: prompt.split()[0].strip("[]") + "-answer", timeout=60)
    assert res.error is None, res.error_text
    assert sorted(res.prompts) == ["[rank0] name for rank 0? ", "[rank1] name for rank 1? "], res.prompts
    assert said(res.stdout, 0, "got rank0-answer") and said(res.stdout, 1, "got rank1-answer"), res.stdout


def test_without_an_input_box_input_fails_at_once_as_in_a_plain_cell(clean_kernel):
    code = "%%ddp --devices 2\ninput('never asked? ')\n"
    res = clean_kernel.collect(clean_kernel.kc.execute(code, allow_stdin=False, stop_on_error=False), timeout=60)
    assert "StdinNotImplementedError" in res.error_text and "does not support input requests" in res.error_text
    assert res.seconds < 20, res.seconds


def test_breakpoint_stops_the_rank_in_pdb_in_the_notebook_and_continue_goes_on(clean_kernel):
    res = clean_kernel.converse(
        "%%ddp --devices 2\nx = 10 * (rank + 1)\nif rank == 1:\n    breakpoint()\ny = x + 1\nprint('y', y)\n",
        answers("p x", "x = 100", "c"), timeout=90)
    assert res.error is None, res.error_text
    assert pdb_prompts(res.prompts, 1) == 3
    assert "[rank1]:20" in res.stdout, res.stdout  # pdb's `p x`, in the rank's output
    assert said(res.stdout, 0, "y 11") and said(res.stdout, 1, "y 101"), res.stdout  # the change took


def test_quitting_pdb_fails_the_cell_as_a_plain_cell_would(clean_kernel):
    res = clean_kernel.converse("%%ddp --devices 2\nimport pdb\nif rank == 0:\n    pdb.set_trace()\nprint('after')\n",
                                answers("q"), timeout=90)
    assert "BdbQuit" in res.error_text and "rank 0" in res.error_text, res.error_text


def test_torch_distributed_breakpoint_stops_one_rank_and_the_others_wait(clean_kernel):
    res = clean_kernel.converse(
        "%%ddp --devices 2\nimport torch.distributed as dist\nv = rank\ndist.breakpoint(rank=1)\nprint('past', v)\n",
        answers("p v", "c"), timeout=90)
    assert res.error is None, res.error_text
    assert pdb_prompts(res.prompts, 1) == 2
    assert said(res.stdout, 0, "past 0") and said(res.stdout, 1, "past 1"), res.stdout


def test_pdb_on_opens_post_mortem_in_the_failed_rank_before_it_is_torn_down(clean_kernel):
    clean_kernel.ok("%pdb on")
    try:
        res = clean_kernel.converse(
            "%%ddp --devices 2\ndef f(k):\n    local = k * 7\n    return {}[k]\nf(rank) if rank == 1 else None\n",
            answers("p local", "c"), timeout=90)
    finally:
        clean_kernel.ok("%pdb off")
    assert pdb_prompts(res.prompts, 1) == 2
    assert "post-mortem (%pdb is on)" in res.stderr, res.stderr
    assert "[rank1]:7" in res.stdout, res.stdout  # the failing frame's local
    assert "KeyError: 1" in res.error_text and "rank 1 failed" in res.error_text, res.error_text


def test_a_pool_keeps_the_failed_ranks_frames_for_ddp_debug_and_cells_can_run_on_some_ranks(clean_kernel):
    clean_kernel.ok("%ddp start --devices 2", timeout=60)
    try:
        failed = clean_kernel.run("%%ddp\ndef g(k):\n    secret = k + 40\n    raise ValueError(k)\ng(rank) if rank == "
                                  "1 "
                                  "else None\n", timeout=60)
        assert "ValueError: 1" in failed.error_text, failed.error_text
        res = clean_kernel.converse("%ddp debug", answers("p secret", "c"), timeout=60)
        assert pdb_prompts(res.prompts, 1) == 2 and "[rank1]:41" in res.stdout, (res.prompts, res.stdout)
        again = clean_kernel.converse("%ddp debug 0", answers(), timeout=60)
        assert "rank 0 kept no failure" in again.error_text, again.error_text

        one = clean_kernel.ok("%%ddp --ranks 1 --gather who\nwho = rank\nprint('only', rank)\nrank * 100\n", timeout=60)
        assert "[rank1]:only 1" in one.stdout and "[rank0]" not in one.stdout, one.stdout
        assert one.result == "100" and clean_kernel.value("who") == [1]
        lone = clean_kernel.run("%%ddp --ranks 0\nimport torch.distributed as dist\nt = torch.ones(1)\n"
                                "dist.all_reduce(t)\n", timeout=60)
        text = lone.error_text
        assert "rank 0 waits in torch.distributed.all_reduce" in text and "rank 1 does not run this cell" in text, text
        assert lone.seconds < 20, lone.seconds
        both = clean_kernel.ok("%%ddp\nimport torch.distributed as dist\nt = "
                               "torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())\n", timeout=60)
        assert said(both.stdout, 0, "sum 2.0") and said(both.stdout, 1, "sum 2.0"), both.stdout  # the pool lives on
        bad = clean_kernel.run("%%ddp --ranks 5\nprint(1)\n", timeout=30)
        assert "the pool has rank(s) 0-1" in bad.error_text, bad.error_text
    finally:
        clean_kernel.ok("%ddp stop", timeout=60)
    alone = clean_kernel.run("%%ddp --ranks 0\nprint(1)\n", timeout=30)
    assert "no pool is running" in alone.error_text, alone.error_text


def test_who_and_diff_show_where_ranks_disagree(clean_kernel):
    clean_kernel.ok("%ddp start --devices 2", timeout=60)
    try:
        clean_kernel.ok("%%ddp\nimport torch.distributed as dist\nfrom torch.nn.parallel import "
                        "DistributedDataParallel as DDP\n"
                        "torch.manual_seed(0)\nmodel = DDP(torch.nn.Linear(4, 2))\nw = torch.zeros(3 + rank)\nsteps = "
                        "5\n"
                        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                        "model(torch.randn(8, 4)).sum().backward(); opt.step()\n"
                        "from collections import OrderedDict\nfrom math import sqrt\nclass Mine:\n    pass\n"
                        "def helper():\n    return 1\n", timeout=60)
        who = clean_kernel.ok("%ddp who", timeout=60).shown
        rows = {line.split()[0]: line for line in who.splitlines()[2:]}
        assert "Tensor" in rows["w"] and "≠ rank 0: (3,) float32 cpu; rank 1: (4,) float32 cpu" in rows["w"], who
        assert "DistributedDataParallel" in rows["model"] and "10 parameters" in rows["model"], who
        assert rows["steps"].split()[1:] == ["int", "5"] and "≠" not in rows["steps"], who
        assert "rank" not in rows and "dist" not in rows, who  # injected names and modules are not listed
        # as IPython's %who, less what is not the user's data: IPython's own names, imported classes/functions
        assert not {"open", "exit", "In", "DDP", "OrderedDict", "sqrt", "torch", "os"} & set(rows), who
        assert "type" in rows["Mine"] and "function" in rows["helper"], who  # the notebook's own are listed

        same = clean_kernel.ok("%ddp diff model.state_dict()", timeout=60).shown
        assert "2 ranks: all 2 entries agree" in same, same  # DDP kept the replicas in sync
        clean_kernel.ok("%%ddp --ranks 1\nwith torch.no_grad():\n    model.module.bias.add_(0.5)\ntorch.rand(3)\n",
                        timeout=60)
        off = clean_kernel.ok("%ddp diff model.state_dict()", timeout=60).shown
        assert "1 of 2 entries differs" in off and "module.bias" in off and "module.weight" not in off, off
        assert "largest relative gap" in off, off
        table = [d["data"]["text/html"] for d in clean_kernel.ok("%ddp diff model.state_dict()", timeout=60).displays
                 if "text/html" in d.get("data", {})]
        assert len(table) == 1 and 'title="module.bias"' in table[0], table  # one output: text and HTML
        optim = clean_kernel.ok("%ddp diff opt.state_dict()", timeout=60).shown
        assert "2 ranks: all" in optim and "agree" in optim, optim  # SGD's param groups, the same on both
        rng = clean_kernel.ok("%ddp diff torch.get_rng_state()", timeout=60).shown
        assert "1 of 1 entry differs" in rng, rng  # rank 1 drew numbers rank 0 did not
        bad = clean_kernel.run("%ddp diff no_such_name", timeout=60)
        assert "NameError" in bad.error_text, bad.error_text
    finally:
        clean_kernel.ok("%ddp stop", timeout=60)


def test_an_interrupt_ends_a_ranks_wait_for_input(clean_kernel):
    def interrupt(prompt):
        clean_kernel.interrupt()  # the user presses Interrupt instead of typing
        return None

    res = clean_kernel.converse("%%ddp --devices 2\nif rank == 0:\n    input('waiting? ')\nprint('never')\n",
                                lambda prompt: interrupt(prompt), timeout=60)
    assert res.prompts == ["[rank0] waiting? "], res.prompts
    text = res.error_text  # (rank 1 may or may not have finished its cell when the interrupt came)
    assert "KeyboardInterrupt" in text and "rank 0 was at Cell In[" in text and "input('waiting? ')" in text, text


def test_a_pause_in_pdb_does_not_trip_the_timeout(clean_kernel):
    def slow(prompt):
        if not slow.waited:
            slow.waited = True
            time.sleep(4)  # the user reads the frame for longer than --timeout
        return "c"
    slow.waited = False

    res = clean_kernel.converse("%%ddp --devices 2 --timeout 3\nif rank == 1:\n    breakpoint()\nprint('done')\n",
                                slow, timeout=60)
    assert res.error is None, res.error_text
    assert said(res.stdout, 0, "done") and said(res.stdout, 1, "done"), res.stdout


def test_diff_compares_the_shard_each_rank_holds_for_fsdp2(clean_kernel):
    clean_kernel.ok("%ddp start --devices 2", timeout=60)
    try:
        clean_kernel.ok("%%ddp\nfrom torch.distributed.fsdp import fully_shard\ntorch.manual_seed(0)\n"
                        "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
                        "for layer in net:\n    fully_shard(layer)\nfully_shard(net)\n", timeout=120)
        out = clean_kernel.ok("%ddp diff net.state_dict()", timeout=60).shown
        assert "DTensor entries: each rank's own shard compared" in out, out
        assert "0.weight" in out, out  # rank 0 holds rows 0-3, rank 1 rows 4-7: different shards
        who = clean_kernel.ok("%ddp who", timeout=60).shown
        assert "net" in who and "Sequential" in who, who
    finally:
        clean_kernel.ok("%ddp stop", timeout=60)


def test_a_spawned_rank_says_why_it_cannot_read_the_input_box(clean_kernel):
    res = clean_kernel.converse("%%ddp --devices 2 --start-method spawn\ninput('x? ')\n", answers(), timeout=120)
    assert res.prompts == [], res.prompts
    assert "StdinNotImplementedError" in res.error_text and "no command pipe" in res.error_text, res.error_text


def test_pdb_on_opens_post_mortem_in_a_pool_rank_and_the_pool_lives_on(clean_kernel):
    clean_kernel.ok("%ddp start --devices 2", timeout=60)
    clean_kernel.ok("%pdb on")
    try:
        res = clean_kernel.converse("%%ddp\nfactor = 3 + rank\nif rank == 0:\n    1 / 0\n", answers("p factor", "c"),
                                    timeout=60)
        assert pdb_prompts(res.prompts, 0) == 2 and "[rank0]:3" in res.stdout, (res.prompts, res.stdout)
        assert "ZeroDivisionError" in res.error_text and "The pool and its state survived" in res.error_text
        after = clean_kernel.ok("%%ddp --gather f\nf = factor\n", timeout=60)
        assert clean_kernel.value("f") == [3, 4], after.stdout
    finally:
        clean_kernel.ok("%pdb off")
        clean_kernel.ok("%ddp stop", timeout=60)


def frames_listed(stdout, rank):
    """The functions of the frames pdb printed on ``rank``, in order: where it stopped, each frame ``where``
    lists (oldest first), each frame ``up`` moved to (lines ``file(n)func()``)."""
    import re

    plain = re.sub(r"\x1b\[[0-9;]*m", "", stdout)
    return re.findall(rf"^\[rank{rank}\]:.*\(\d+\)(<?\w+>?)\(\)$", plain, re.M)


NBDDP_FRAMES = ("server.py", "jobs.py", "worker.py", "nbddp")


def test_ddp_debug_starts_at_the_cells_frame_and_up_stops_there(clean_kernel):
    clean_kernel.ok("%ddp start --devices 2", timeout=60)
    try:
        clean_kernel.run("%%ddp\ndef g(k):\n    secret = k + 40\n    raise ValueError(k)\ng(rank) if rank == 1 else "
                         "None\n",
                         timeout=60)
        res = clean_kernel.converse("%ddp debug", answers("where", "up", "up", "c"), timeout=60)
    finally:
        clean_kernel.ok("%ddp stop", timeout=60)
    # stopped in g; `where`: the cell, then g; `up`: the cell; `up` again: nothing older
    assert frames_listed(res.stdout, 1) == ["g", "<module>", "g", "<module>"], res.stdout
    assert not any(name in res.stdout for name in NBDDP_FRAMES), res.stdout
    assert "Oldest frame" in res.stdout, res.stdout


def test_pdb_on_post_mortem_starts_at_the_cells_frame(clean_kernel):
    clean_kernel.ok("%pdb on")
    try:
        res = clean_kernel.converse("%%ddp --devices 2\ndef f(k):\n    return {}[k]\nf(rank) if rank == 1 else None\n",
                                    answers("where", "up", "up", "c"), timeout=90)
    finally:
        clean_kernel.ok("%pdb off")
    assert frames_listed(res.stdout, 1) == ["f", "<module>", "f", "<module>"], res.stdout
    assert not any(name in res.stdout for name in NBDDP_FRAMES) and "Oldest frame" in res.stdout, res.stdout


def test_breakpoint_and_torch_breakpoint_start_at_the_users_frames(clean_kernel):
    res = clean_kernel.converse("%%ddp --devices 2\ndef h():\n    if rank == 1:\n        breakpoint()\n    return "
                                "1\nh()\n",
                                answers("where", "up", "up", "c"), timeout=90)
    assert res.error is None, res.error_text
    assert frames_listed(res.stdout, 1) == ["h", "<module>", "h", "<module>"], res.stdout
    assert not any(name in res.stdout for name in NBDDP_FRAMES) and "Oldest frame" in res.stdout, res.stdout

    res = clean_kernel.converse("%%ddp --devices 2\nimport torch.distributed as dist\ndist.breakpoint(rank=0)\n",
                                answers("where", "up", "up", "c"), timeout=90)
    assert res.error is None, res.error_text
    # torch stops in its own breakpoint() ("Type 'up' to get to the frame that called dist.breakpoint")
    assert frames_listed(res.stdout, 0) == ["breakpoint", "<module>", "breakpoint", "<module>"], res.stdout
    assert "server.py" not in res.stdout and "jobs.py" not in res.stdout and "Oldest frame" in res.stdout, res.stdout


@pytest.mark.unit
def test_a_diff_row_fits_the_notebook_and_keeps_the_whole_in_its_title():
    from nbddp.kernel.names import survey_tables

    key = "module.model.layers.12.self_attention.query_key_value.weight"

    def fp(h, n):
        return {"what": "(4096, 4096) float32", "hash": h, "norm": n, "sum": 1.0}

    per_rank = [{key: fp(str(r), 12.3456 + r / 1e4), "bias": fp("same", 1.0)} for r in range(4)]
    text = survey_tables.diff_table("model.state_dict()", per_rank)
    rows = text.splitlines()[1:]
    assert len(rows) == 2 and all(len(row) <= survey_tables.WIDTH for row in rows), text
    assert "…" in rows[1] and rows[1].split()[0].endswith("key_value.weight"), text  # the key's end kept
    assert "largest relative gap" in rows[1], text  # the gap first: what the eye looks for
    page = survey_tables._html(*survey_tables.diff_parts("model.state_dict()", per_rank), survey_tables.DIFF_CAPS)
    assert f'title="{key}"' in page and "text-overflow:ellipsis" in page and "rank 3: 12.3459" in page, page
