"""Issue 9 through a real kernel: rich outputs from ranks, values from every rank, results that keep
their identity, exits and set-up failures that say what happened."""
import re

import pytest

pytestmark = pytest.mark.timeout(180)


def sequence(kernel, code, timeout=60):
    """Run a cell; return (result, [(kind, content)...]) in the order the front end received them."""
    seen = []
    res = kernel.collect(kernel.execute(code), timeout, on_message=lambda k, c: seen.append((k, c)))
    return res, seen


def test_a_figure_and_an_html_table_from_rank_0_arrive_as_png_and_html(clean_kernel):
    k = clean_kernel
    k.ok("import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
         "import matplotlib.pyplot as plt\nimport pandas as pd")
    res, seen = sequence(k, (
        "%%ddp --devices 2\n"
        "if rank == 0:\n"
        "    print('before the plot')\n"
        "    plt.plot([1, 3, 2]); plt.title('loss'); plt.show()\n"
        "    print('between')\n"
        "    display(pd.DataFrame({'rank': [0, 1], 'loss': [0.5, 0.25]}))\n"
        "    print('after the table')\n"
    ))
    assert res.error is None, res.error_text
    displays = [c for kind, c in seen if kind == "display_data" and "image/png" in c["data"] or
                kind == "display_data" and "<table" in c["data"].get("text/html", "")
                and "nbddp-run" not in c["data"]["text/html"]]
    png = [c for c in displays if "image/png" in c["data"]]
    html = [c for c in displays if "text/html" in c["data"]]
    assert len(png) == 1 and len(html) == 1, seen
    import base64

    assert base64.b64decode(png[0]["data"]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<td>0.25</td>" in html[0]["data"]["text/html"]
    # in order with the rank's text: before, plot, between, table, after
    order = []
    for kind, c in seen:
        if kind == "stream":
            order += [w for w in ("before the plot", "between", "after the table") if w in c["text"]]
        elif kind == "display_data" and ("image/png" in c["data"] or c in displays):
            order.append("png" if "image/png" in c["data"] else "table")
    assert order == ["before the plot", "png", "between", "table", "after the table"], order


def test_a_figure_drawn_but_never_shown_appears_as_the_cell_ends(clean_kernel):
    k = clean_kernel
    k.ok("import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
         "import matplotlib.pyplot as plt")
    res = k.ok("%%ddp --devices 2 --ranks-output 0\nplt.plot([rank, 1])\n;")
    assert sum("image/png" in d["data"] for d in res.displays) == 1, res.displays


def test_other_ranks_displays_are_labelled_and_ranks_output_governs_them(clean_kernel):
    k = clean_kernel
    res = k.ok("%%ddp --devices 2\nfrom IPython.display import HTML, display\ndisplay(HTML(f'<i>from {rank}</i>'))\n")
    html = sorted(d["data"]["text/html"] for d in res.displays if "<i>" in d["data"].get("text/html", ""))
    assert html == ["<i>from 0</i>", "<i>from 1</i>"]
    assert "[rank1]: display" in res.stdout and "[rank0]: display" in res.stdout  # every rank's, labelled alike
    only0 = k.ok("%%ddp --devices 2 --ranks-output 0\nfrom IPython.display import HTML, display\n"
                 "display(HTML(f'<i>from {rank}</i>'))\n")
    assert [d["data"]["text/html"] for d in only0.displays
            if "<i>" in d["data"].get("text/html", "")] == ["<i>from 0</i>"]


@pytest.mark.timeout(180)
def test_a_spawned_ranks_displays_are_rich_too(clean_kernel):
    """A spawned rank runs outside any IPython shell, where display() prints only repr: it gets a quiet
    shell of its own (the same holds for a Ray pool's ranks on other nodes, forked by their agent)."""
    res = clean_kernel.ok("%%ddp --devices 2 --start-method spawn\nfrom IPython.display import HTML, display\n"
                          "print('before', flush=True)\ndisplay(HTML(f'<i>from {rank}</i>'))\nprint('after')\n",
                          timeout=150)
    html = sorted(d["data"]["text/html"] for d in res.displays if "<i>" in d["data"].get("text/html", ""))
    assert html == ["<i>from 0</i>", "<i>from 1</i>"], res.displays
    assert "HTML object" not in res.stdout, res.stdout
    for r in (0, 1):
        mine = [line for line in res.stdout.splitlines()
                if line.startswith(f"[rank{r}]:") or line.startswith("[rank0-1]:")]
        # (a line both ranks printed alike at once may show once, as [rank0-1]:after)
        assert mine[-2][-len(" display"):] == " display" and mine[-1] in (f"[rank{r}]:after", "[rank0-1]:after"), \
            res.stdout


def test_clear_output_from_a_rank_clears_only_what_that_rank_displayed(clean_kernel):
    k = clean_kernel
    res, seen = sequence(k, (
        "%%ddp --devices 2\nimport torch.distributed as dist\n"
        "from IPython.display import HTML, display, clear_output\n"
        "display(HTML(f'<i>first from {rank}</i>'))\n"
        "dist.barrier()\n"
        "if rank == 1:\n    clear_output()\n    display(HTML('<i>second from 1</i>'))\n"
    ))
    assert res.error is None, res.error_text
    ids = {}
    for kind, c in seen:
        if kind == "display_data" and "<i>first" in c["data"].get("text/html", ""):
            ids[c["data"]["text/html"]] = c["transient"]["display_id"]
    updates = [(c["transient"]["display_id"], c["data"]) for kind, c in seen if kind == "update_display_data"
               and c["transient"]["display_id"] in ids.values()]
    assert updates, seen
    touched = {i for i, _ in updates}
    assert touched == {ids["<i>first from 1</i>"]}, "only rank 1's output may change"
    assert updates[-1][1].get("text/html") == "<i>second from 1</i>"  # its next display reuses the slot


def test_display_ids_from_a_rank_update_in_place_and_widgets_fall_back_to_text(clean_kernel):
    k = clean_kernel
    res = k.ok("%%ddp --devices 2 --ranks-output 0\nfrom IPython.display import display\nimport ipywidgets\n"
               "h = display('step 0', display_id=True)\nh.update('step 9')\n"
               "display(ipywidgets.IntSlider(value=3))\n")
    first = next(d for d in res.displays if d["data"].get("text/plain") == "'step 0'")
    upd = [d for d in res.displays if d["data"].get("text/plain") == "'step 9'"]
    assert upd and upd[0]["transient"]["display_id"] == first["transient"]["display_id"]
    slider = [d for d in res.displays if "IntSlider" in d["data"].get("text/plain", "")]
    assert slider and all("application/vnd.jupyter.widget-view+json" not in d["data"] for d in slider)
    assert not res.comms


def test_gather_brings_every_ranks_value_in_rank_order(clean_kernel):
    k = clean_kernel
    k.ok("%%ddp --devices 2 --gather loss shard\nloss = 0.5 / (rank + 1)\nshard = torch.arange(3) + 10 * rank\n")
    assert k.value("loss") == [0.5, 0.25]
    assert k.value("[s.tolist() for s in shard]") == [[0, 1, 2], [10, 11, 12]]


def test_a_notebook_dataclass_comes_back_as_the_notebooks_own_class(clean_kernel):
    k = clean_kernel
    k.ok("from dataclasses import dataclass\n@dataclass\nclass Metrics:\n    loss: float\n"
         "def scale(x):\n    return 2 * x\n")
    k.ok("%%ddp --devices 2 --out m f --gather g\nm = Metrics(0.1 * (rank + 1))\nf = scale\ng = Metrics(rank)\n")
    assert k.value("(isinstance(m, Metrics), m.loss, f is scale, [isinstance(x, Metrics) for x in g])") == (
        True, 0.1, True, [True, True])
    # a class the cell itself defines has no notebook twin: it travels by value
    k.ok("%%ddp --devices 2 --out n\nclass Metrics2:\n    pass\nn = Metrics2()\n")
    assert k.value("type(n).__name__") == "Metrics2"
    # spawn gets it right through cloudpickle's class tracking
    k.ok("%%ddp --devices 2 --start-method spawn --out m2\nm2 = Metrics(3.0)\n", timeout=120)
    assert k.value("isinstance(m2, Metrics)") is True


def test_a_ddp_model_in_out_is_refused_with_what_to_send_and_the_rest_arrive(clean_kernel):
    k = clean_kernel
    res = k.run("%%ddp --devices 2 --out model state epoch\n"
                "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
                "state = model.module.state_dict()\nepoch = 3\n")
    assert res.error and res.error["ename"] == "ResultError", res
    text = res.error_text
    assert "--out model: rank 0's `model`: torch.nn.parallel.distributed.DistributedDataParallel" in text
    assert "send model.module.state_dict()" in text
    assert "these arrived: state, epoch" in text
    assert "Default process group" not in text
    assert k.value("(epoch, sorted(state))") == (3, ["bias", "weight"])


def test_a_value_over_the_limit_names_rank_name_and_size(clean_kernel):
    k = clean_kernel
    res = k.run("%%ddp --devices 2 --max-value-mb 1 --gather big small\n"
                "big = torch.zeros((rank + 1) * 200_000)\nsmall = rank\n")
    assert res.error and res.error["ename"] == "ResultError", res
    assert re.search(r"--gather big: rank 1's `big`: torch.Tensor is 1\.5 MiB pickled, over the limit of 1\.0 MiB "
                     r"\(--max-value-mb\)", res.error_text), res.error_text
    assert "rank 0's `big`" not in res.error_text  # 0.8 MB: under the limit
    assert k.value("small") == [0, 1]


def test_an_early_sys_exit_is_named_as_the_cause(clean_kernel):
    k = clean_kernel
    res = k.run("%%ddp --devices 2\nimport sys, torch.distributed as dist\nif rank == 1:\n    sys.exit(0)\n"
                "dist.all_reduce(torch.ones(1))\n", timeout=60)
    assert res.error and res.error["ename"] == "RankFailure", res
    text = res.error_text
    assert re.search(r"rank 1 left early: it called sys.exit\(0\) at Cell In\[\d+\], line 4: sys.exit\(0\)", text), text
    assert "rank 0 also failed (likely a consequence)" in text
    assert "barrier" not in text.lower()


def test_exit_in_a_rank_ends_that_ranks_cell_as_in_a_script(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2 --ranks-output 0\nprint('one')\nexit()\nprint('never')\n")
    assert res.error is None and "never" not in res.stdout and "[rank0]:one" in res.stdout


@pytest.mark.parametrize("target,phase", [
    ("torch.distributed.init_process_group", "joining the process group"),
    ("torch.set_num_threads", "setting torch's thread count"),
])
def test_a_failure_in_a_ranks_set_up_is_reported_with_its_phase_and_message(clean_kernel, target, phase):
    k = clean_kernel
    module, name = target.rsplit(".", 1)
    k.ok(f"import {module}\n_orig = {target}\n"
         f"def _broken(*a, **kw):\n    raise RuntimeError('injected into {name}')\n{target} = _broken\n")
    try:
        res = k.run("%%ddp --devices 2\nprint('never runs')\n", timeout=60)
    finally:
        k.ok(f"{target} = _orig")
    assert res.error and res.error["ename"] == "RankFailure", res
    assert re.search(rf"rank [01] failed while {phase}: RuntimeError: injected into {name}",
                     res.error_text), res.error_text
    assert "code 70" not in res.error_text and "never runs" not in res.stdout


COUNT_HANDLERS = ("[sum(getattr(getattr(cb, '__self__', None), '__module__', '').startswith('nbddp') "
                  "for cb in get_ipython().events.callbacks[e]) for e in ('pre_run_cell', 'post_run_cell')]")


def test_reload_ext_registers_each_handler_once(clean_kernel):
    k = clean_kernel
    once = k.value(COUNT_HANDLERS)
    assert all(n >= 1 for n in once)
    k.ok("%reload_ext nbddp")
    k.ok("%reload_ext nbddp")
    assert k.value(COUNT_HANDLERS) == once
    k.ok("%unload_ext nbddp")
    assert k.value(COUNT_HANDLERS) == [0, 0]
    k.ok("%load_ext nbddp")
    assert k.value(COUNT_HANDLERS) == once
