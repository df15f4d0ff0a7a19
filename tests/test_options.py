"""Issue 17: one options table. Everything derives from it, and bad input on every path (one-shot cell, pool
cell, %ddp start/restart, the Python API) is refused before anything changes, naming the option and the fix."""
import dataclasses
import re

import pytest

import nbddp
from helpers import pool_pids
from nbddp.kernel import options

pytestmark = pytest.mark.timeout(240)

# (option text, what the refusal says): one per check in the table
BAD = [
    ("--timeout -1", "--timeout -1.0: need a number of seconds > 0"),
    ("--threads 0", "--threads 0: need a whole number >= 1"),
    ("--max-lines -1", "--max-lines -1: need a whole number >= 0"),
    ("--max-line-chars 0", "--max-line-chars 0: need a whole number >= 1"),
    ("--max-output-mb -1", "--max-output-mb -1.0: need a size in MiB >= 0"),
    ("--max-value-mb 0", "--max-value-mb 0.0: need a size in MiB > 0"),
    ("--seed -3", "--seed -3: need a whole number >= 0"),
    ("--nodes 0", "--nodes 0: need a whole number >= 1"),
    ("--cluster slurm", "--cluster 'slurm': need ray, or ray:ADDRESS"),
]


@pytest.mark.unit
def test_config_and_the_magic_derive_from_the_one_table():
    with pytest.raises(TypeError):
        options.Config("auto")  # keyword only: positional options were how launch() once drifted
    fields = {f.name: f.default for f in dataclasses.fields(options.Config)}
    assert fields == {o.name: o.default for o in options.OPTIONS if o.scope != options.NAMES}
    from nbddp.kernel.magic import DDPMagics

    doc = DDPMagics.ddp.__doc__
    for o in options.OPTIONS:
        assert o.flag in doc, o.flag
        assert " ".join(o.help.split()[:4]) in " ".join(doc.split()), o.name
    for title in options.GROUPS.values():
        assert title in doc
    assert set(options.POOL_FIXED) == {"devices", "accelerator", "backend", "start_method", "threads", "seed",
                                       "cluster", "nodes", "on_loss", "keep"}


@pytest.mark.parametrize("line", ["-d3", "-d 3", "--devices=3", "--devices 3", "--threads 1 -d3"])
def test_every_spelling_of_an_option_is_read_the_same(line):
    assert options.parse(line)["devices"] == "3"


@pytest.mark.unit
def test_a_parse_holds_only_what_was_given():
    assert options.parse("") == {}
    assert options.parse("--no-prefix --out a b") == {"prefix": False, "out": ["a", "b"]}


@pytest.mark.parametrize("text,said", BAD)
def test_each_check_refuses_in_the_parse_and_in_the_python_api(text, said):
    with pytest.raises(nbddp.UsageError, match=re.escape(said)):
        options.parse(text)
    flag, value = text.split()
    name = flag[2:].replace("-", "_")
    with pytest.raises(nbddp.UsageError, match=re.escape(said)):
        nbddp.launch(print, **{name: options.BY_NAME[name].type(value)})  # refused before anything forks
    with pytest.raises(nbddp.UsageError, match=re.escape(said)):
        nbddp.Pool(**{name: options.BY_NAME[name].type(value)}).check()


@pytest.mark.unit
def test_choices_and_unknown_keywords_are_refused_by_name():
    with pytest.raises(nbddp.UsageError, match="--ranks-output '2': choose all, 0, none"):
        nbddp.launch(print, ranks_output="2")
    with pytest.raises(nbddp.UsageError, match="unknown option.*devicez"):
        nbddp.Pool(devicez=2)
    with pytest.raises(nbddp.UsageError, match="a pool forks its ranks"):
        nbddp.Pool(start_method="spawn").check()


@pytest.mark.parametrize("line,n", [("--devices=2", 2), ("-d3", 3), ("-d 0,1", 2), ("--devices auto", None)])
def test_export_reads_devices_with_the_magics_own_parser(line, n):
    from nbddp.export.script import export_cells

    script = export_cells([f"%%ddp {line}\nprint(rank)"], source="t", script="t.py")
    assert f"--nproc-per-node {n or 2} " in script, script[:400]  # auto: the script's own default, 2


# -- through a real kernel -----------------------------------------------------------------------------
def test_one_shot_cell_with_a_bad_option_runs_nothing(clean_kernel):
    k = clean_kernel
    for text, said in BAD:
        res = k.run(f"%%ddp --devices 2 {text}\nprint('ran')\n")
        assert said in res.error_text and "Nothing ran" in res.error_text, res.error_text
        assert "ran" not in res.stdout
    res = k.run("%%ddp --ranks-output 2\nprint('ran')\n")  # argparse's own choice check
    assert "invalid choice: '2'" in res.error_text and "ran" not in res.stdout


# a line that does not parse, and what the refusal says
UNPARSED = [('--devices 2 --out "x', "a quotation mark is not closed"),
            ("--devices 2 x \\", "it ends with a backslash"),
            ("--devcies 2", "unrecognized arguments: --devcies 2"),
            ("--timeout soon", "argument --timeout: invalid float value: 'soon'"),
            ("--out", "expected at least one argument")]


@pytest.mark.parametrize("line,said", UNPARSED)
def test_a_line_that_does_not_parse_is_nbddps_usage_error_saying_what_was_wrong(line, said):
    with pytest.raises(nbddp.UsageError, match=re.escape(said)):
        options.parse(line)


def test_bad_quoting_and_other_parse_failures_run_nothing_in_a_kernel(clean_kernel):
    """``%%ddp --out "x`` was a bare ``ValueError: No closing quotation``; IPython printed argparse's complaints
    (not an error: a notebook running all cells went on). Each is an error of its own now, and nothing ran."""
    k = clean_kernel
    cells = [f"%%ddp {line}\nprint('ran')\n" for line, _ in UNPARSED] + ['%ddp start --devices "2']
    for code, said in zip(cells, [s for _, s in UNPARSED] + ["a quotation mark is not closed"]):
        res = k.run(code)
        assert res.error and res.error["ename"] == "UsageError", (code, res)
        assert said in res.error_text and "Nothing ran" in res.error_text, (code, res.error_text)
        assert "ValueError" not in res.error_text and "Traceback" not in res.error_text, res.error_text
        assert "ran" not in res.stdout and not k.process().children(), "nothing was launched"


@pytest.fixture
def pool(pool):
    """conftest.py's pool, each rank holding ``state`` (41 + rank)."""
    pool.ok("%%ddp\nstate = 41 + rank\n")
    return pool


def assert_pool_kept(k, pids):
    assert pool_pids(k) == pids, "the pool's ranks were not touched"
    k.ok("%%ddp --gather seen\nseen = state\n")
    assert k.value("seen") == [41, 42], "the ranks' state is still there"


def test_pool_cells_refuse_bad_options_and_clashes_and_keep_the_pool(pool):
    k = pool
    pids = pool_pids(k)
    for text, said in BAD:
        if text.startswith("--threads") or text.startswith("--seed"):
            continue  # fixed for the pool's life: a clash (below)
        res = k.run(f"%%ddp {text}\nstate = -1\n")
        assert said in res.error_text and "Nothing ran" in res.error_text, (text, res.error_text)
    for line in ("-d3", "--devices=3", "--devices 3", "--threads 2", "--start-method spawn"):
        res = k.run(f"%%ddp {line}\nstate = -1\n")
        assert "which the running pool cannot change; nothing ran" in res.error_text, (line, res.error_text)
    k.ok("%%ddp --devices 2\nimport time\n")  # the pool's own value is no clash
    assert_pool_kept(k, pids)


def test_start_and_restart_refuse_bad_options_before_touching_the_running_pool(pool):
    k = pool
    pids = pool_pids(k)
    res = k.run("%ddp start --devices 1")
    assert "a pool is already running" in res.error_text
    for line in ("restart --start-method spawn", "restart --threads 0", "restart --timeout -1",
                 "restart --out x", "restart --devices banana", "restart --bogus 1"):
        res = k.run(f"%ddp {line}")
        assert res.error_text and ("Nothing ran" in res.error_text or "is not a device spec" in res.error_text
                                   or "unrecognized arguments" in res.error_text), (line, res.error_text)
    assert "a pool forks its ranks" in k.run("%ddp restart --start-method spawn").error_text
    assert "--out and --gather bring values back from it" in k.run("%ddp restart --out x").error_text
    assert_pool_kept(k, pids)


def test_start_refuses_names_options_and_starts_nothing(clean_kernel):
    k = clean_kernel
    res = k.run("%ddp start --devices 2 --timeout 5 --out x")
    assert "--out and --gather bring values back from it" in res.error_text
    assert not k.process().children(), "no pool was started"
    assert "no pool is running" in k.ok("%ddp status").stdout


def test_cell_options_given_at_start_are_the_pools_defaults(clean_kernel):
    k = clean_kernel
    k.ok("%ddp start --devices 2 --timeout 1.5 --ranks-output 0")
    try:
        res = k.ok("%%ddp\nprint('hello from', rank)\n")
        assert "hello from 0" in res.stdout and "hello from 1" not in res.stdout, res.stdout
        slow = k.run("%%ddp\nimport time\ntime.sleep(20)\n", timeout=60)
        assert slow.seconds < 15 and "1.5" in slow.error_text and "survived" in slow.error_text, slow.error_text
        both = k.ok("%%ddp --ranks-output all --timeout 30\nprint('hello from', rank)\n")  # a cell's own win
        assert "hello from 1" in both.stdout
    finally:
        k.ok("%ddp stop")


@pytest.mark.unit
def test_export_keeps_going_past_a_line_the_magic_refused():
    from nbddp.export.script import export_cells

    script = export_cells(["%%ddp --devcies 2\nprint(rank)", "%%ddp -d 3\nprint(rank)"], source="t", script="t.py")
    assert "--nproc-per-node 3 " in script, script[:400]


@pytest.mark.unit
def test_help_opens_with_usage_and_an_example_and_shows_no_rest_markup():
    from nbddp.kernel.magic import DDPMagics

    for doc, usage in ((DDPMagics.ddp.__doc__, "%%ddp [options]"),
                       (DDPMagics.ddp_pool.__doc__, "%ddp start [options]")):
        lines = doc.splitlines()
        assert lines[0].startswith(usage) and lines[2].lstrip().startswith(usage.split()[0]), lines[:4]
        assert "``" not in doc and "::" not in [ln.strip() for ln in lines], doc[:300]
