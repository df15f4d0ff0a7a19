"""Hosted notebooks (Colab, Kaggle) and the IPython stacks they run: IPython 7.34, ipykernel 6.17,
ipywidgets 7.7 / 8.1, tqdm 4.67 (.ci/colab-constraints.txt, .ci/kaggle-constraints.txt). These tests pass
on every stack nbddp supports; .ci/run runs them in the Colab-like and Kaggle-like venvs too (tqdm's
text bars in a rank: tests/test_streaming.py, also run there)."""
import linecache
import re
import sys
import traceback
import types

import pytest

import nbddp
from kernel import said
from nbddp.hw import cuda, nccl
from nbddp.ipy import cells, session, tracebacks
from nbddp.kernel import devices
from nbddp.kernel.ranks import starters

# -- which host -------------------------------------------------------------------------------------
KERNEL = type("Shell", (), {"kernel": object()})()


@pytest.mark.parametrize(
    "env, modules, kind",
    [
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {"google.colab": 1}, "kaggle"),  # Kaggle's image is Colab's
        ({"KAGGLE_URL_BASE": "https://www.kaggle.com"}, {}, "kaggle"),
        ({"KAGGLE_USERNAME": "me", "KAGGLE_KEY": "k"}, {"google.colab": 1}, "colab"),  # the Kaggle API on Colab
        ({"COLAB_RELEASE_TAG": "release-colab_20260801"}, {}, "colab"),
        ({"KAGGLE_USERNAME": "me", "KAGGLE_KEY": "k"}, {}, "jupyter"),
    ],
)
@pytest.mark.unit
def test_kaggle_is_told_from_colab(env, modules, kind):
    assert session.session_kind(env=env, modules=modules, shell=KERNEL) == kind


@pytest.mark.unit
def test_environment_says_what_kaggle_allows_and_needs(monkeypatch):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    env = nbddp.environment()
    assert env.session == "kaggle" and env.widgets
    assert env.nccl == {"NCCL_P2P_DISABLE": "1"}
    text = str(env)
    assert "nccl:      NCCL_P2P_DISABLE=1 (set in GPU ranks unless you set it)" in text
    assert "Kaggle: up to 2 GPUs (2xT4: --devices 2, NCCL, peer-to-peer off)" in text


@pytest.mark.unit
def test_environment_says_what_colab_allows(monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("KAGGLE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    env = nbddp.environment()
    assert env.session == "colab" and env.nccl == {}
    assert "nccl:" not in str(env) and "Colab: one GPU at most (--devices auto runs one rank)" in str(env)


@pytest.mark.unit
def test_kaggle_gpu_ranks_get_p2p_off_unless_the_user_set_it(monkeypatch):
    plan = devices.Plan("cuda", "nccl", (0, 1))
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    assert starters._rank_env(plan, 1, "r", 29500, 1, "lo")["NCCL_P2P_DISABLE"] == "1"
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")  # the user's own: the rank inherits it, nbddp adds nothing
    assert "NCCL_P2P_DISABLE" not in starters._rank_env(plan, 1, "r", 29500, 1, "lo")
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE")
    assert "NCCL_P2P_DISABLE" not in nccl.rank_env("lo", "jupyter")


# -- cells on an IPython that keeps no file name -> cell map (7.x) -----------------------------------
class Compiler7:
    """IPython 7.34's CachingCompiler as nbddp meets it: ``cache`` and ``get_code_name``, no map."""

    def get_code_name(self, raw_code, transformed_code, number):
        return f"/tmp/ipykernel_0/{abs(hash(raw_code))}.py"  # ipykernel names a cell by its code

    def cache(self, transformed_code, number=0, raw_code=None):
        name = self.get_code_name(raw_code or transformed_code, transformed_code, number)
        linecache.cache[name] = (len(transformed_code), None, transformed_code.splitlines(True), name)
        return name


def shell7(*codes):
    history = types.SimpleNamespace(input_hist_parsed=[""], input_hist_raw=[""])
    shell = types.SimpleNamespace(compile=Compiler7(), history_manager=history)
    for code in codes:  # cells run before %load_ext nbddp; IPython's history keeps them without trailing newlines
        history.input_hist_parsed.append(code.rstrip("\n"))
        history.input_hist_raw.append(code.rstrip("\n"))
        shell.compile.cache(code, len(history.input_hist_parsed) - 1, raw_code=code)
    return shell


@pytest.mark.unit
def test_cells_are_numbered_where_ipython_keeps_no_map():
    shell = shell7("import torch", "x = torch.ones(2)\n")
    earlier = shell.compile.get_code_name("x = torch.ones(2)\n", "", 2)
    cells.track(shell)
    cells.track(shell)  # %reload_ext: still one recorder
    assert cells.numbers(shell) == {shell.compile.get_code_name("import torch", "", 1): 1, earlier: 2}
    shell.history_manager.input_hist_parsed.append("y = 1\n")  # IPython stores a cell before running it
    assert cells.running(shell) == 3
    name = shell.compile.cache("y = 1\n", cells.running(shell), raw_code="y = 1\n")
    assert cells.numbers(shell)[name] == 3
    labels = tracebacks.cell_labels(shell)
    assert labels[earlier] == "Cell In[2]" and labels[name] == "Cell In[3]"
    assert tracebacks.relabel(f'File "{name}", line 1, in <module>', labels) == "Cell In[3], line 1, in <module>"


@pytest.mark.unit
def test_the_cuda_guard_names_the_cell_where_ipython_keeps_no_map():
    shell = shell7("import torch\n")
    shell.events = types.SimpleNamespace(register=lambda *a: None, unregister=lambda *a: None)
    cells.track(shell)
    name = shell.compile.cache("x = 1\nt = torch.ones(1).cuda()\n", 2, raw_code="x = 1\nt = torch.ones(1).cuda()\n")
    guard = cuda.Cuda()
    guard.install(shell, cells)
    try:
        frame = traceback.FrameSummary(name, 2, "<module>", line="t = torch.ones(1).cuda()")
        site = guard._site_from_stack([frame])
    finally:
        guard.uninstall(shell)
    assert str(site) == "In [2], line 2: t = torch.ones(1).cuda()"


# -- through a real kernel: whatever IPython, ipykernel, ipywidgets and tqdm this venv has -------------
def test_a_ddp_cell_and_the_notebook_cells_it_calls_are_labelled_with_their_numbers(clean_kernel):
    k = clean_kernel
    n = k.value("len(In)")  # the next cell is In[n]
    k.ok("def scale(v):\n    return v / 0\n")
    text = k.run("%%ddp --devices 2\nx = 1\nscale(rank)\n", timeout=60).error_text
    assert f"Cell In[{n}], line 2, in scale" in text, text
    assert f"Cell In[{n + 1}], line 3" in text, text
    assert "ipykernel_" not in text, text


def test_a_widget_made_in_a_rank_never_sends_on_the_kernels_sockets(clean_kernel):
    """ipywidgets 7 (and 8 on ipykernel < 6.18) open ipykernel's own Comm, which writes on the kernel's
    iopub socket; from a fork ipykernel only logs "attempted to send message from fork"."""
    res = clean_kernel.ok(
        "%%ddp --devices 2\nimport ipywidgets\nsession = get_ipython().kernel.session\nsent = []\n"
        "send = session.send\nsession.send = lambda *a, **k: sent.append(a[1]) or send(*a, **k)\n"
        "w = ipywidgets.IntSlider(value=3)\nw.value = 4\nw.close()\nsession.send = send\n"
        "print('sent', len(sent))\n", timeout=60)
    assert said(res.stdout, 0, "sent 0") and said(res.stdout, 1, "sent 0"), res.stdout + res.stderr
    assert not res.comms and "from fork" not in res.stdout + res.stderr



def test_the_pool_view_names_the_cell_it_ran(clean_kernel):
    k = clean_kernel
    k.ok("%ddp start --devices 2")
    try:
        n = k.value("len(In)")
        k.ok("%%ddp\nimport time\nx = rank\n")
        text = k.ok("%ddp status").displays[-1]["data"]["text/plain"]
    finally:
        k.ok("%ddp stop")
    assert re.search(rf"^cells: Cell In\[{n}\] · ", text, re.MULTILINE), text
    assert "import time" not in text
