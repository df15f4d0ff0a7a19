"""Regenerate the tutorial notebooks: python notebooks/_build.py (executes each one, saves its outputs).

The cells live here so the tutorials stay consistent; CI runs the saved notebooks with nbval
(``--nbval-lax``: every cell must run as written, cells tagged NBVAL_CHECK_OUTPUT must also match), and
strictly (``--nbval --nbval-sanitize-with notebooks/nbval-sanitize.cfg``: every output must match, nbddp's
timings, memory figures, run directories and live views sanitized).
"""
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent
md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell

NOTEBOOKS = {
    "01-quickstart.ipynb": [
        md("# Quickstart: train on 2 ranks from a notebook\n\n`%%ddp` runs a cell on every rank of a "
           "`torch.distributed` job forked from this kernel. On a GPU machine it uses every GPU (NCCL); here, "
           "2 CPU ranks (gloo). The same notebook runs unchanged on both."),
        code("%load_ext nbddp\nimport nbddp, torch\nprint(nbddp.environment())"),
        md("Build the data **once, in the notebook**. Every rank is a fork of this kernel, so `X` and `Y` are "
           "shared copy-on-write: no copies, no pickling."),
        code("torch.manual_seed(0)\nX = torch.randn(100_000, 16)\nY = X @ torch.randn(16, 1) + 0.01 * torch.randn(100_000, 1)"),
        md("The cell below runs on each rank with `rank`, `local_rank`, `world_size` and `device` defined and the "
           "process group ready. Every rank's output arrives as whole `[rankN]:` lines, and a line every rank "
           "prints alike appears once, as `[rank0-1]:`; above the output, a dashboard shows each rank's state, time "
           "and memory (and GPU) while it runs, and stays as a summary. `--seed 0` makes every rerun draw the same "
           "numbers; `--out state` brings rank 0's `state` back; the last expression is the cell's result."),
        code("%%ddp --devices 2 --seed 0 --out state\n"
             "import torch.distributed as dist\n"
             "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1).to(device))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "x, y = X[rank::world_size].to(device), Y[rank::world_size].to(device)\n"
             "for epoch in range(3):\n"
             "    for i in range(0, len(x), 5_000):\n"
             "        opt.zero_grad()\n"
             "        loss = torch.nn.functional.mse_loss(model(x[i:i + 5_000]), y[i:i + 5_000])\n"
             "        loss.backward()\n"
             "        opt.step()\n"
             "    mean = loss.detach().clone()\n"
             "    dist.all_reduce(mean)                 # the loss over every rank: the same line on each\n"
             "    print(f'epoch {epoch} mean loss {mean.item() / world_size:.4f}')\n"
             "state = model.module.state_dict()\n"
             "round(loss.item(), 2)"),
        code("# NBVAL_CHECK_OUTPUT\nprint({k: tuple(v.shape) for k, v in state.items()}, state['weight'].device)"),
        code("assert 'rank' not in globals()  # the notebook's namespace only gained `state`"),
    ],
    "02-shared-datasets.ipynb": [
        md("# Shared datasets: what copy-on-write shares, and what breaks it\n\nA forked rank sees the notebook's "
           "memory without copying it, until it writes to a page. Tensors stay shared when ranks only read them. "
           "Python objects do not: reading one updates its reference count, which writes to its page, so every "
           "rank ends up with its own copy. The dashboard shows this live: USS is what a rank holds privately, "
           "*shared* is what it still shares."),
        code("%load_ext nbddp\nimport torch\nbig = torch.ones(64 * 2**20)  # 256 MB tensor\nnames = [f'sample-{i}' for i in range(1_000_000)]  # a Python list of 1M strings"),
        code("%%ddp --devices 2 --out report\n"
             "import psutil, torch.distributed as dist\n"
             "def uss_mb():\n"
             "    return psutil.Process().memory_full_info().uss / 2**20\n"
             "start = uss_mb()\n"
             "total = big[rank::world_size].sum().item()      # read the tensor\n"
             "after_tensor = uss_mb()\n"
             "n = sum(len(s) for s in names)                   # read the Python list\n"
             "after_list = uss_mb()\n"
             "mine = [after_tensor - start, after_list - after_tensor]\n"
             "allr = [None] * world_size\n"
             "dist.all_gather_object(allr, mine)\n"
             "report = {'tensor_mb': max(r[0] for r in allr), 'list_mb': max(r[1] for r in allr)}\n"
             "if rank == 0:  # every rank's figures, one line each (equal lines from two ranks would show once)\n"
             "    for r, (t, l) in enumerate(allr):\n"
             "        print(f'rank {r}: private memory added by reading the tensor: {t:.0f} MB, the list: {l:.0f} MB')"),
        code("print(f\"reading 256 MB of tensor made each rank copy at most {report['tensor_mb']:.0f} MB\")\n"
             "print(f\"reading a list of 1M strings made a rank copy {report['list_mb']:.0f} MB\")\n"
             "assert report['tensor_mb'] < 0.05 * 256, report\n"
             "assert report['list_mb'] > report['tensor_mb'], report"),
        md("## Python objects, shared: `nbddp.shared`\n\nA dataset made of Python objects (a list of dicts, a "
           "DataFrame with a Python string column) is copied into every rank, page by page, as the rank reads it, "
           "and again into each DataLoader worker. nbddp says so when it happens: a cell whose rank grew by 100 MiB "
           "or more while it read such a notebook variable ends with a note naming it, the figures, and the fix."),
        code("rows = [{'id': i, 'text': f'sample text number {i}', 'label': i % 7} for i in range(2_000_000)]"),
        code("%%ddp --devices 2 --gather total\n"
             "total = sum(r['label'] + len(r['text']) for r in rows)   # every rank reads every row"),
        md("The fix is one line in the notebook: `nbddp.shared(rows)` is a read-only twin of the list whose items "
           "live pickled in one shared buffer. Reading an item unpickles a fresh copy of it from bytes nobody "
           "writes, so the buffer's pages stay shared by every rank and every loader worker they fork. It reads "
           "as the list does (`len`, indexing, slices, iteration), and also takes a pandas DataFrame or Series "
           "(strings in Arrow buffers, numbers as numpy arrays)."),
        code("import nbddp\nplain_total = sum(total)\nrows = nbddp.shared(rows)\nrows"),
        code("%%ddp --devices 2 --gather total grew\n"
             "import psutil\n"
             "start = psutil.Process().memory_full_info().uss\n"
             "total = sum(r['label'] + len(r['text']) for r in rows)\n"
             "grew = (psutil.Process().memory_full_info().uss - start) / 2**20"),
        code("print(f\"reading the shared rows made each rank copy at most {max(grew):.0f} MB\")\n"
             "assert sum(total) == plain_total and max(grew) < 20, grew"),
        md("**What to do:** keep datasets as tensors or numpy arrays built in the notebook (they stay shared as "
           "they are), and pass lists of Python objects and DataFrames through `nbddp.shared` before the `%%ddp` "
           "cell. A twin made after `%ddp start` reaches the pool's ranks as a handle of a few hundred bytes, "
           "once. `THP_MEM_ALLOC_ENABLE=1`, which nbddp sets at `%load_ext`, also keeps the fork itself cheap "
           "when the kernel holds many GB of tensors."),
    ],
    "03-metrics-and-results.ipynb": [
        md("# Metrics, results and plots\n\nRanks are a real process group, so metric libraries sync across them. Results come back four ways: `--out NAME` (rank 0's variables), `--gather NAME` (a list of every rank's), the last expression (rank 0's value, as `Out[n]`), and `nbddp.launch` (every rank's return value). A plot drawn on a rank appears in the cell, as in any notebook cell."),
        code('%load_ext nbddp\nimport nbddp, torch'),
        code("%%ddp --devices 2 --out mean\nimport torchmetrics\nmetric = torchmetrics.MeanMetric()\nmetric.update(torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([6.0, 7.0, 9.0]))\nmean = metric.compute()   # synced across ranks: the mean of all five values\nprint(f'rank {rank} sees {mean.item():.1f}')"),
        code('# NBVAL_CHECK_OUTPUT\nmean'),
        code("%%ddp --devices 2 --gather losses\ntorch.manual_seed(rank)\nlosses = [1.0 / (step + 1) + 0.05 * torch.rand(1).item() for step in range(20)]   # each rank's own curve\nprint(f'rank {rank}: final loss {losses[-1]:.3f}')"),
        code('# NBVAL_CHECK_OUTPUT\nlen(losses), [len(l) for l in losses]   # one list per rank, in rank order'),
        code("import matplotlib.pyplot as plt\nplt.rcParams['figure.figsize'] = (5, 3)"),
        code("%%ddp --devices 2 --ranks-output 0\nimport torch.distributed as dist\ncurve = torch.tensor([1.0 / (step + 1) for step in range(20)])\ndist.all_reduce(curve)                       # a collective, then a plot on rank 0\nif rank == 0:\n    plt.plot((curve / world_size).tolist(), label='mean loss over ranks')\n    plt.xlabel('step'); plt.legend(); plt.show()"),
        code('def shard_sum(n):\n    import torch.distributed as dist\n    part = torch.arange(n)[dist.get_rank()::dist.get_world_size()].sum()\n    return int(part)\n\nparts = nbddp.launch(shard_sum, 1000, devices=2)\nparts'),
        code('# NBVAL_CHECK_OUTPUT\nsum(parts) == sum(range(1000))'),
    ],
    "04-lightning-and-accelerate.ipynb": [
        md("# Bringing Lightning and Accelerate code\n\nnbddp sets the torchrun environment and the process group "
           "before the cell runs, so Lightning's `strategy=\"ddp\"` and Accelerate's `Accelerator` find an "
           "already-launched job and join it instead of starting processes of their own. A rank is not an "
           "interactive session, so Lightning does not refuse `ddp` even when it was imported in the notebook."),
        code("%load_ext nbddp\nimport logging, warnings\nimport torch, pytorch_lightning as pl\n"
             "# quiet what Lightning itself says, which differs by machine and version (the ranks are forks: they\n"
             "# inherit both): its banner and tips, and a deprecation inside its own code it has yet to fix\n"
             "logging.getLogger('pytorch_lightning').setLevel(logging.WARNING)\n"
             "warnings.filterwarnings('ignore', message='.*LeafSpec', module='pytorch_lightning')"),
        code("class Regression(pl.LightningModule):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.layer = torch.nn.Linear(4, 1)\n"
             "    def training_step(self, batch, _):\n"
             "        x, y = batch\n"
             "        return torch.nn.functional.mse_loss(self.layer(x), y)\n"
             "    def configure_optimizers(self):\n"
             "        return torch.optim.SGD(self.parameters(), lr=0.1)\n\n"
             "data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))"),
        code("%%ddp --devices 2 --out weight\n"
             "trainer = pl.Trainer(accelerator='auto', devices=world_size, strategy='ddp', max_epochs=2, logger=False,\n"
             "                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
             "model = Regression()\n"
             "trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32))\n"
             "print(f'Lightning: world_size={trainer.world_size} global_rank={trainer.global_rank}')\n"
             "weight = model.layer.weight.detach()"),
        code("# NBVAL_CHECK_OUTPUT\ntuple(weight.shape)"),
        code("%%ddp --devices 2\n"
             "from accelerate import Accelerator\n"
             "acc = Accelerator(cpu=device.type == 'cpu')\n"
             "print(f'Accelerate: {acc.num_processes} processes, this is #{acc.process_index}')\n"
             "total = acc.reduce(torch.tensor([float(rank + 1)], device=acc.device), reduction='sum')\n"
             "total.item()"),
    ],
    "05-failures.ipynb": [
        md("# Failures: what you see, and how to read it\n\nEvery failure ends the cell within seconds, names the "
           "rank and the cause, stops the other ranks and leaves no process behind. The next `%%ddp` works.\n\n"
           "**Interrupt** (the stop button) stops every rank and ends the cell with `KeyboardInterrupt`; the kernel "
           "and its variables stay. (An interrupt cannot be shown in a notebook that is run top to bottom, so it "
           "is not in this one; the test suite covers it.)"),
        code("%load_ext nbddp\nimport torch"),
        md("An exception on one rank while the other waits in a collective: the traceback points into this cell."),
        code("%%ddp --devices 2\n# NBVAL_RAISES_EXCEPTION\nimport torch.distributed as dist\n"
             "if rank == 1:\n    raise ValueError('bad batch on rank 1')\ndist.all_reduce(torch.ones(1))"),
        md("A hang: `--timeout` stops the run and shows where every rank was."),
        code("%%ddp --devices 2 --timeout 3\n# NBVAL_RAISES_EXCEPTION\nimport time, torch.distributed as dist\n"
             "def wait_for_data():\n    while True:\n        time.sleep(0.1)\n"
             "if rank == 0:\n    wait_for_data()   # rank 0 never reaches the barrier\ndist.barrier()"),
        md("A rank killed outright (what the out-of-memory killer does):"),
        code("%%ddp --devices 2\n# NBVAL_RAISES_EXCEPTION\nimport os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
             "time.sleep(60)  # rank 0 is stopped as soon as rank 1 is gone"),
        md("Bad input launches nothing:"),
        code("%%ddp --devices 0,0\n# NBVAL_RAISES_EXCEPTION\nprint('never runs')"),
        md("And after all that, the kernel is fine:"),
        code("%%ddp --devices 2 --ranks-output none\n# NBVAL_CHECK_OUTPUT\nworld_size"),
    ],
    "06-export-to-torchrun.ipynb": [
        md("# From notebook to torchrun\n\nWhen a job outgrows one machine, the same cells become a script for "
           "`torchrun` (or SLURM `srun`): `%ddp_export train.py` (or `nbddp export NOTEBOOK.ipynb -o train.py`) "
           "writes the `%%ddp` cells, and the plain cells they need, around a process group that torchrun sets up."),
        code("%load_ext nbddp"),
        code("import torch\ntorch.manual_seed(0)\nX = torch.randn(4096, 8)\nY = X.sum(dim=1, keepdim=True)"),
        code("%%ddp --devices 2\n"
             "import torch.distributed as dist\n"
             "torch.manual_seed(0)\n"
             "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
             "for step in range(50):\n"
             "    opt.zero_grad()\n"
             "    loss = torch.nn.functional.mse_loss(model(X[rank::world_size]), Y[rank::world_size])\n"
             "    loss.backward()\n"
             "    opt.step()\n"
             "final = loss.detach().clone()\n"
             "dist.all_reduce(final)\n"
             "round(final.item() / world_size, 4)"),
        code("%ddp_export train.py"),
        code("import shutil, subprocess, sys, pathlib\n"
             "torchrun = shutil.which('torchrun') or str(pathlib.Path(sys.executable).with_name('torchrun'))\n"
             "run = subprocess.run([torchrun, '--standalone', '--nproc-per-node', '2', 'train.py'],\n"
             "                     capture_output=True, text=True, timeout=300)\n"
             "print(run.stdout)\n"
             "assert run.returncode == 0, run.stderr\n"
             "cell_result = Out[max(Out)]  # what the %%ddp cell showed as its Out[n]\n"
             "assert run.stdout.strip() == repr(cell_result), (run.stdout, cell_result)"),
        md("Across machines, run the same script with `torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d "
           "--rdzv-endpoint HOST:29500 train.py`, or under SLURM with `srun torchrun ...`; see docs/user-guide.md."),
    ],
    "07-fsdp2.ipynb": [
        md("# FSDP2 in a notebook\n\nLightning refuses FSDP in an interactive session and Accelerate's `notebook_launcher` does not "
           "document it. In a `%%ddp` cell it is plain PyTorch: `fully_shard` each layer, train, bring the full state "
           "dict back to the notebook, and save/load a `torch.distributed.checkpoint`."),
        code("%load_ext nbddp\nimport tempfile, torch\n"
             "torch.manual_seed(0)\nX = torch.randn(4096, 64)\nY = torch.sin(X.sum(1, keepdim=True))\n"
             "ckpt = tempfile.mkdtemp(prefix='fsdp2-ckpt-')  # a distributed checkpoint is a directory\n"
             "def make_model():\n"
             "    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))"),
        md("Each rank holds 1/world_size of every parameter, its gradient and its Adam state. The cell measures "
           "what a rank holds (the local shards' bytes) against what DDP would hold (the whole model, replicated)."),
        code("%%ddp --devices 2 --out full_state memory\n"
             "import torch.distributed as dist, torch.distributed.checkpoint as dcp\n"
             "from torch.distributed.fsdp import fully_shard\n"
             "from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions\n"
             "torch.manual_seed(0)\n"
             "model = make_model()\n"
             "for layer in model:\n"
             "    if isinstance(layer, torch.nn.Linear):\n"
             "        fully_shard(layer)\n"
             "fully_shard(model)\n"
             "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
             "x, y = X[rank::world_size], Y[rank::world_size]\n"
             "for step in range(100):\n"
             "    opt.zero_grad()\n"
             "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
             "    loss.backward()\n"
             "    opt.step()\n"
             "local = lambda t: t.to_local() if hasattr(t, 'to_local') else t\n"
             "held = sum(local(p).nbytes + local(p.grad).nbytes for p in model.parameters())\n"
             "held += sum(local(v).nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())\n"
             "ddp = 4 * sum(p.numel() for p in model.parameters()) * 4  # params + grads + Adam's two moments, fp32\n"
             "memory = {'fsdp2_bytes': held, 'ddp_bytes': ddp, 'ratio': round(held / ddp, 3)}\n"
             "print(f'rank {rank}: holds {held / 2**10:.0f} KiB; DDP would hold {ddp / 2**10:.0f} KiB')\n"
             "full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
             "dcp.save({'model': model.state_dict()}, checkpoint_id=ckpt)\n"
             "round(loss.item(), 2)  # FSDP's reductions may differ in the last digits from run to run"),
        code("# NBVAL_CHECK_OUTPUT\n"
             "print(memory['ratio'])  # the sharded part: 1/world_size\n"
             "assert abs(memory['ratio'] - 1 / 2) < 0.01, memory\n"
             "ref = make_model()\nref.load_state_dict(full_state)  # the full model, back in the notebook\n"
             "with torch.no_grad():\n"
             "    notebook_loss = torch.nn.functional.mse_loss(ref(X), Y).item()\n"
             "print({k: tuple(v.shape) for k, v in full_state.items()})"),
        md("A fresh sharded model loads the checkpoint (each rank reads only its shards) and scores the same."),
        code("%%ddp --devices 2 --out loaded_loss\n"
             "import torch.distributed.checkpoint as dcp\n"
             "from torch.distributed.fsdp import fully_shard\n"
             "model = make_model()\n"
             "for layer in model:\n"
             "    if isinstance(layer, torch.nn.Linear):\n"
             "        fully_shard(layer)\n"
             "fully_shard(model)\n"
             "state = {'model': model.state_dict()}\n"
             "dcp.load(state, checkpoint_id=ckpt)\n"
             "model.load_state_dict(state['model'])\n"
             "with torch.no_grad():\n"
             "    loaded_loss = torch.nn.functional.mse_loss(model(X), Y).item()\n"
             "round(loaded_loss, 4)"),
        code("assert abs(loaded_loss - notebook_loss) < 1e-5, (loaded_loss, notebook_loss)\n"
             "import shutil; shutil.rmtree(ckpt)\nprint('checkpoint round trip matches the notebook')"),
    ],
    "08-pool.ipynb": [
        md("# A pool: ranks that live across cells\n\n`%ddp start` forks one rank per device from the kernel once: the notebook's data is shared copy-on-write, and the process group is set up once. Every `%%ddp` cell then runs in those same ranks, so a model, its optimizer and anything else a cell builds stay there for the next cell. Train, look, change something in the notebook, go on. `%ddp stop` ends the ranks."),
        code('%load_ext nbddp\nimport torch\nimport matplotlib.pyplot as plt\ntorch.manual_seed(0)\nX = torch.randn(4096, 16)\nY = X @ torch.randn(16, 1) + 0.1 * torch.randn(4096, 1)   # shared copy-on-write'),
        code('%ddp start --devices 2 --seed 0'),
        md('Build the model once; it lives in the ranks.'),
        code('%%ddp\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))\nlr = 0.05\nopt = torch.optim.SGD(model.parameters(), lr=lr)\nlosses = []\n\ndef epoch():\n    for i in range(0, 2048, 64):\n        xb, yb = X[rank::world_size][i:i + 64], Y[rank::world_size][i:i + 64]\n        opt.zero_grad()\n        loss = torch.nn.functional.mse_loss(model(xb), yb)\n        loss.backward(); opt.step()\n        losses.append(loss.item())'),
        md("Two epochs, then bring every rank's losses back with `--gather` and plot them in the notebook."),
        code("%%ddp --gather losses\nepoch(); epoch()\nif rank == 0:\n    print(f'{len(losses)} steps, last loss {losses[-1]:.3f}')"),
        code("for r, curve in enumerate(losses):\n    plt.plot(curve, label=f'rank {r}')\nplt.yscale('log'); plt.xlabel('step'); plt.legend(); plt.show()"),
        code('# NBVAL_CHECK_OUTPUT\nlen(losses), [len(c) for c in losses]'),
        md("Change the learning rate in the notebook. The next cell that reads `new_lr` gets the notebook's value (nbddp says what it sent), and training goes on in the same ranks, with the same model and optimizer."),
        code('new_lr = 0.01'),
        code('%%ddp --gather losses\nfor group in opt.param_groups:\n    group[\'lr\'] = new_lr\nepoch()\nprint(f\'{len(losses)} steps, lr {opt.param_groups[0]["lr"]}\')'),
        code('# NBVAL_CHECK_OUTPUT\n[len(c) for c in losses], losses[0][-1] < losses[0][0]'),
        md("A bad batch on one rank. Rank 1 raises while rank 0 already waits in DDP's gradient all_reduce, a wait no KeyboardInterrupt can reach. nbddp frees rank 0 by having every rank leave the process group and make a fresh one: the cell fails within seconds naming rank 1's error, and the pool, the model and the optimizer stay."),
        code("%%ddp\n# NBVAL_RAISES_EXCEPTION\ndef bad_step():\n    xb = X[rank::world_size][:64]\n    if rank == 1:\n        raise ValueError('a corrupt sample on rank 1')\n    opt.zero_grad()\n    torch.nn.functional.mse_loss(model(xb), Y[rank::world_size][:64]).backward()\nbad_step()"),
        md("The message says what became of the DDP wrapper: it was bound to the old group, and nbddp made it anew on the new one (the same module, the same options). Go on from where training was."),
        code("%%ddp --gather losses\nepoch()\nif rank == 0:\n    print(f'{len(losses)} steps, last loss {losses[-1]:.3f}')"),
        code('# NBVAL_CHECK_OUTPUT\n[len(c) for c in losses], losses[0][-1] < losses[0][0]'),
        code('%ddp status'),
        code('%ddp stop'),
    ],
    "09-debugging.ipynb": [
        md("# Debugging across ranks\n\nThe notebook is where a person sits at the keyboard while the ranks run, so "
           "nbddp lets you step into a rank: `input()`, `breakpoint()` and pdb on a rank use the notebook's input box "
           "(the prompt says which rank, `[rank1] (Pdb)`), IPython's `%pdb on` opens post-mortem in the rank that "
           "failed, and in a pool `%ddp debug` opens it after the fact, `%%ddp --ranks 1` runs a cell on one rank, "
           "and `%ddp who` / `%ddp diff` compare the ranks. JupyterLab's debugger panel reaches the ranks too "
           "(the last section)."),
        md("The parts that wait for you to type are shown here as text, because this notebook is also run "
           "unattended by the test suite, where there is no input box (there, `input()` on a rank fails at once "
           "with `StdinNotImplementedError`, as in a plain cell). In JupyterLab, try:\n\n"
           "```python\n%%ddp --devices 2\nx = 10 * (rank + 1)\nif rank == 1:\n    breakpoint()      # rank 1 stops "
           "in pdb; type `p x`, then `c`\nprint(x)\n```\n\n"
           "Rank 0 goes on until it waits for rank 1 (in a collective, or at the end of the cell). While a rank "
           "sits in pdb nbddp's own clocks (`--timeout`, its health checks) stop; the process group's timeout "
           "(30 min by default) does not. `torch.distributed.breakpoint(rank=1)` works too: the other ranks "
           "wait in its barrier."),
        code('%load_ext nbddp\nimport torch\ntorch.manual_seed(0)\nX = torch.randn(2048, 16)\nY = X @ torch.randn(16, 1)'),
        code('%ddp start --devices 2 --seed 0'),
        code("%%ddp\nfrom torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)   # the same "
             "initial weights on every rank\nmodel = DDP(torch.nn.Linear(16, 1))\nopt = torch.optim.SGD(model.parameters(), "
             "lr=0.05)\nfor i in range(0, 1024, 64):\n    xb, yb = X[rank::world_size][i:i + 64], "
             "Y[rank::world_size][i:i + 64]\n    opt.zero_grad(); torch.nn.functional.mse_loss(model(xb), yb).backward(); "
             "opt.step()"),
        md("`%ddp who` lists what the ranks hold, one row per name, marked `≠` where ranks disagree in type or "
           "shape. `%ddp diff EXPR` evaluates `EXPR` on every rank and compares it entry by entry by fingerprint "
           "(shape, dtype, a hash of the bytes, the norm): are the DDP replicas still in sync?"),
        code('# NBVAL_CHECK_OUTPUT\n%ddp diff model.state_dict()'),
        md("A cell on one rank: look at or change rank 1 only. Here we knock its replica out of sync, as a bug "
           "might, and `%ddp diff` finds the entry and says by how much."),
        code('%%ddp --ranks 1\nwith torch.no_grad():\n    model.module.bias.add_(0.25)\nmodel.module.bias'),
        code('# NBVAL_CHECK_OUTPUT\n%ddp diff model.state_dict()'),
        md("Bring the replicas back in line from rank 0, on every rank, and check again."),
        code('%%ddp\nimport torch.distributed as dist\nfor p in model.module.parameters():\n    dist.broadcast(p.data, src=0)'),
        code('# NBVAL_CHECK_OUTPUT\n%ddp diff model.state_dict()'),
        md("A failure on one rank. The pool keeps the failed rank's frames until the next cell: `%ddp debug` (or "
           "`%ddp debug 1`) opens pdb there, in the input box, at the failing line, with its locals. With "
           "`%pdb on` it opens by itself as the rank fails, before anything is torn down."),
        code("%%ddp\n# NBVAL_RAISES_EXCEPTION\ndef check_batch(xb):\n    if rank == 1:\n        bad = xb.abs().max()\n"
             "        raise ValueError(f'rank 1: a batch with |x| up to {bad:.1f}')\ncheck_batch(X[rank::world_size][:64])"),
        md("In JupyterLab: `%ddp debug` → `[rank1] ipdb>` → `p bad` → `c`."),
        code('%ddp who'),
        code('%ddp stop'),
        md("## JupyterLab's debugger panel\n\nJupyterLab's visual debugger reaches into the ranks. Turn it on for "
           "the kernel (the bug icon in the notebook's toolbar), click in the gutter of a `%%ddp` cell to set a "
           "breakpoint (line numbers are the cell's own: the `%%ddp` line is line 1), and run the cell: every rank "
           "that reaches the line stops there.\n\n"
           "![JupyterLab's debugger stopped at line 4 of a %%ddp --devices 2 cell: the Callstack lists rank 0 and "
           "rank 1, the Variables panel shows rank 1's variables](../docs/images/debugger-ranks.png)\n\n"
           "- The **Callstack** lists the frames of every stopped rank, each named `rank N · MainThread · <function>`. "
           "Click one to see that rank's **variables**; the **Debug Console** evaluates in that rank.\n"
           "- **Continue** lets every rank go; **Next**, **Step in** and **Step out** act on the rank that stopped last.\n"
           "- `breakpoint()` in a cell stops in the panel while the debugger is on, and is pdb in the input box otherwise.\n"
           "- It works for one-shot cells and pools (a pool started before the debugger was on connects at its next "
           "cell). Turning the debugger off lets stopped ranks run on. With it off, nothing is loaded or traced in the "
           "ranks; with it on, they run traced, as the kernel does.\n\n"
           "Try it in JupyterLab on a cell of your own, with a breakpoint on line 4 (`total = ...`):\n\n"
           "```python\n%%ddp --devices 2\nimport torch\nx = torch.arange(4) + 10 * rank\ntotal = int(x.sum())\n"
           "print('total', rank, total)\n```\n\n"
           "docs/user-guide.md has the rules (what Pause does, what the panel does not reach)."),
    ],
    "10-ray-cluster.ipynb": [
        md("# A pool across machines, on Ray\n\n`%ddp start --cluster ray --nodes N --devices D` starts a pool whose ranks span the nodes of a Ray cluster: this kernel's node runs ranks 0..D-1, forked from the kernel as in any pool; each other node runs its ranks, forked by an agent nbddp places there. Cells, output, values and failures work as in a pool on one machine. See docs/ray.md for starting Ray on real machines (SLURM included) and the security notes.\n\nThis tutorial runs anywhere: it starts a Ray cluster of **two raylets on this one machine** (`ray.cluster_utils.Cluster`), which Ray treats as two nodes. On a real cluster, replace the next cell with `ray.init(address='auto')`."),
        code("%load_ext nbddp\nimport torch\nimport ray\nfrom ray.cluster_utils import Cluster\n\ncluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 1})  # node 0: this kernel's\ncluster.add_node(num_cpus=1)                                             # node 1\nray.init(address=cluster.address, logging_level='ERROR', log_to_driver=False)\nlen([n for n in ray.nodes() if n['Alive']])"),
        md("The notebook's data, built before the pool starts. The kernel's node shares it copy-on-write; the other node does not share this kernel's memory, so a name a cell reads is sent there once, and nbddp says so."),
        code("torch.manual_seed(0)\nX = torch.randn(4096, 16)\nY = X @ torch.randn(16, 1) + 0.1 * torch.randn(4096, 1)"),
        code("%ddp start --cluster ray --nodes 2 --devices 1 --seed 0"),
        md("Each rank knows its node: the environment is torchrun's for 2 nodes (`NODE_RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`). An `all_reduce` spans the nodes."),
        code("%%ddp --gather where\nimport os, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nwhere = {'rank': rank, 'node': os.environ['NODE_RANK'], 'local_rank': local_rank, 'sum': t.item()}\nprint(f\"node {os.environ['NODE_RANK']} says hello\")"),
        code("# NBVAL_CHECK_OUTPUT\nwhere"),
        md("Train a DDP model across the two nodes. `X` and `Y` reach node 1 once, with this cell; the model and optimizer live in the ranks for the next cells."),
        code("%%ddp\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.05)\nlosses = []\nfor i in range(0, 2048, 64):\n    xb, yb = X[rank::world_size][i:i + 64], Y[rank::world_size][i:i + 64]\n    opt.zero_grad()\n    loss = torch.nn.functional.mse_loss(model(xb), yb)\n    loss.backward(); opt.step()\n    losses.append(loss.item())"),
        code("%%ddp --gather w\nw = model.module.weight.detach().clone()"),
        code("# NBVAL_CHECK_OUTPUT\nlen(w), torch.equal(w[0], w[1])  # the replicas agree across nodes"),
        md("A failure on the other node names the rank and its node, and the pool lives on, with its state."),
        code("%%ddp\n# NBVAL_RAISES_EXCEPTION\nif rank == 1:\n    raise ValueError('a corrupt shard on node 1')"),
        code("%%ddp --gather n\nn = len(losses)"),
        code("# NBVAL_CHECK_OUTPUT\nn"),
        code("%ddp stop"),
        code("ray.shutdown()\ncluster.shutdown()"),
    ],
    "11-background-training.ipynb": [
        md("# Long training in the background\n\n`%%ddp --bg` sends a cell to the ranks and gives the notebook back at "
           "once: the cell returns as soon as its ranks have it, and you go on working (look at the data, plot, "
           "write the next cell) while they train. Its `--out`/`--gather` names arrive in the notebook when it has "
           "ended; a cell that reads one of them first waits for it, so the same notebook, run top to bottom "
           "(nbval, papermill, \"Run All\"), gives the same results as run by hand."),
        code("%load_ext nbddp\nimport torch\nimport matplotlib.pyplot as plt\ntorch.manual_seed(0)\n"
             "X = torch.randn(4096, 16)\nY = X @ torch.randn(16, 1) + 0.1 * torch.randn(4096, 1)   # shared copy-on-write"),
        code("%ddp start --devices 2 --seed 0"),
        md("## Send the training to the background\n\nThe cell below returns within a fraction of a second. Its "
           "output (each rank's lines, the tqdm bars, the pool's line for the cell and, at the end, its outcome) "
           "keeps arriving **in this cell** in JupyterLab, however many cells you run meanwhile (VS Code: until "
           "you run another cell; see docs/environments.md).\n\n"
           "*In this saved notebook* the cell shows only what arrived before it returned: a notebook run top to "
           "bottom (as this one was built) records a cell's output while it runs. `%ddp attach`, further down, "
           "shows all of it. What a background cell shows depends on timing, so its cell (and the others that "
           "look at it while it runs) carries `# NBVAL_IGNORE_OUTPUT`: nbval, which tests this notebook, "
           "compares every other cell's output."),
        code("%%ddp --bg --gather losses\n"
             "# 4 epochs of DDP training, each rank on its half of the data, with a progress bar\n"
             "# NBVAL_IGNORE_OUTPUT\n"
             "import time\n"
             "from tqdm.auto import tqdm\n"
             "from torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n"
             "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.02)\n"
             "data = TensorDataset(X, Y)\n"
             "sampler = DistributedSampler(data, seed=0)          # each rank its half, reshuffled every epoch\n"
             "loader = DataLoader(data, batch_size=64, sampler=sampler)\n"
             "losses = []\n"
             "with tqdm(total=4 * len(loader), desc='training') as bar:\n"
             "    for epoch in range(4):\n"
             "        sampler.set_epoch(epoch)\n"
             "        for xb, yb in loader:\n"
             "            opt.zero_grad()\n"
             "            loss = torch.nn.functional.mse_loss(model(xb), yb)\n"
             "            loss.backward()\n"
             "            opt.step()\n"
             "            losses.append(loss.item())\n"
             "            bar.update()\n"
             "            time.sleep(0.05)                     # stands for a bigger model's step\n"
             "print(f'{len(losses)} steps, last loss {losses[-1]:.4f}')"),
        md("## Meanwhile, the notebook is free\n\nA plain cell runs at once, in the kernel, while the ranks train. "
           "(Only a cell that reads `losses` waits, and a blocking `%%ddp` cell: the ranks run one cell at a time.)"),
        code("fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))\n"
             "left.hist(Y.squeeze().numpy(), bins=50)\nleft.set_title('Y')\n"
             "right.scatter(X[:, 0].numpy(), Y.squeeze().numpy(), s=1, alpha=0.3)\n"
             "right.set_xlabel('X[:, 0]'); right.set_ylabel('Y')\nplt.show()\n"
             "print(f'{len(X)} rows, Y mean {Y.mean():.3f}, std {Y.std():.3f}')"),
        md("`%ddp status` shows the pool and the background work: each background cell, its state, its time so far "
           "and each rank's last tqdm fraction."),
        code("# NBVAL_IGNORE_OUTPUT\n%ddp status"),
        md("## The results\n\nThis cell reads `losses`, which the background cell brings back with `--gather`: "
           "it waits for the training to end first (and says so), then runs with the ranks' values. Results land "
           "only between cells (as the next cell starts, or in `%ddp wait`), never in the middle of one."),
        code("# NBVAL_IGNORE_OUTPUT\n"
             "steps = [len(curve) for curve in losses]"),
        md("`%ddp wait` waits for every background cell (`--timeout S` to wait at most S seconds) and brings its "
           "results; a background failure not said yet is raised here, which fails a notebook run top to bottom. "
           "Here the previous cell already waited, so it returns at once."),
        code("%ddp wait"),
        code("# NBVAL_CHECK_OUTPUT\nprint(f'{len(losses)} ranks, {steps} steps; last loss {losses[0][-1]:.4f} (rank 0), '\n"
             "      f'{losses[1][-1]:.4f} (rank 1)')"),
        code("for r, curve in enumerate(losses):\n    plt.plot(curve, label=f'rank {r}')\n"
             "plt.yscale('log'); plt.xlabel('step'); plt.ylabel('MSE'); plt.legend(); plt.show()"),
        md("## Watching it again: `%ddp attach`\n\nAfter a page reload (or in a second tab) the background cell's "
           "output no longer reaches its cell. `%ddp attach`, in any cell, shows the running background cell "
           "there: what it showed so far, then live to its end. Once it has ended, it shows the last one's whole "
           "output, as here."),
        code("# NBVAL_IGNORE_OUTPUT\n%ddp attach"),
        md("## Interrupts\n\n- **The stop button never reaches background ranks.** Jupyter's interrupt stops the "
           "kernel's running cell only: interrupting a plain cell, or a cell waiting for the training (`%ddp wait`, "
           "a cell reading `losses`), stops that cell, or the waiting, and the training goes on.\n"
           "- **`%ddp interrupt` stops the background cell**, as the stop button stops a blocking `%%ddp` cell: "
           "the report (where every rank was) arrives in the background cell's own output, the pool and what "
           "its ranks hold survive, and background cells queued behind it are cancelled.\n\n"
           "A second `%%ddp --bg` cell queues behind the first; a blocking `%%ddp` cell, `%ddp who` or "
           "`%ddp stop` wait for the background work to end (and say so). A background failure is reported in "
           "its own output and said once more in the next cell you run. More in docs/user-guide.md, *Training that "
           "outlives the cell*."),
        code("%ddp stop"),
    ],
    "12-seeing-a-training.ipynb": [
        md("# Seeing a training: loss charts from every rank, the slow rank named, a profile that says why\n\n"
           "`nbddp.log(step=..., loss=...)` in a rank draws live charts in the cell (one panel per name, one line per "
           "rank), kept as a static chart in the saved notebook; `nbddp.metrics()` gives every logged number back as a "
           "DataFrame. A rank that steps slower than the others is named; `%%ddp --profile` shows where each rank's "
           "step goes, and which rank the others wait for."),
        code("%load_ext nbddp\nimport nbddp, torch\ntorch.manual_seed(0)\nX = torch.randn(4096, 32)\n"
             "Y = X @ torch.randn(32, 1) + 0.1 * torch.randn(4096, 1)"),
        md("Two ranks train one model with DDP, each on its half of the data, and log their own loss every step "
           "(each rank's: rank 0's alone would hide a rank that diverges). The chart is drawn below the dashboard "
           "while the cell runs, at most twice a second, and stays when it ends."),
        code("%%ddp --devices 2 --seed 0\n"
             "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
             "x, y = X[rank::world_size], Y[rank::world_size]\n"
             "for step in range(100):\n"
             "    i = (step * 64) % len(x)\n"
             "    loss = torch.nn.functional.mse_loss(model(x[i:i + 64]), y[i:i + 64])\n"
             "    opt.zero_grad(); loss.backward(); opt.step()\n"
             "    nbddp.log(step=step, loss=loss.item(), lr=opt.param_groups[0]['lr'])"),
        md("Everything logged in this kernel, one row per call: `cell`, `rank`, `step`, `time`, then a column per name "
           "(also written as `metrics.csv` in the run's folder)."),
        code("# NBVAL_CHECK_OUTPUT\ndf = nbddp.metrics()\nprint(list(df.columns))\n"
             "print(df.groupby('rank').step.agg(['count', 'min', 'max']))\n"
             "print('loss went down on both ranks:', bool((df[df.step >= 90].groupby('rank').loss.mean() < "
             "df[df.step < 10].groupby('rank').loss.mean()).all()))"),
        md("## A rank made slow on purpose\n\nHere each rank works through its own shard with no collective per step "
           "(preprocessing, evaluation), and rank 1 takes 40 ms a step where rank 0 takes 10 ms. From each rank's "
           "recent step time, a rank at least 1.25× the median is named above the charts (and by `%ddp status` "
           "while a pool cell runs)."),
        code("%%ddp --devices 2\nimport time\n"
             "for step in range(40):\n"
             "    time.sleep(0.04 if rank == 1 else 0.01)\n"
             "    nbddp.log(step=step, items=float(step * 64))"),
        md("## Why a DDP step is slow: `--profile`\n\nIn DDP every rank waits for the slowest in each gradient "
           "all-reduce, so every rank steps at its pace and step times alike name no one. `%%ddp --profile 10` runs "
           "torch.profiler on every rank for 10 optimizer steps, begun at the same step on each, and splits each "
           "rank's time into compute, communication (and, of it, waiting for other ranks), data loading and the "
           "rest. Rank 1 sleeps 50 ms a step here (a slow data source, say): rank 0's bar is mostly waiting, and "
           "the line under the bars names rank 1. Each rank's trace (Chrome/Perfetto JSON with `distributedInfo`, "
           "readable by Holistic Trace Analysis) is written beside its log."),
        code("%%ddp --devices 2 --seed 0 --profile 10\nimport time\n"
             "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
             "for step in range(12):\n"
             "    if rank == 1:\n"
             "        time.sleep(0.05)\n"
             "    loss = model(torch.randn(64, 256)).pow(2).mean()\n"
             "    opt.zero_grad(); loss.backward(); opt.step()"),
        code("# NBVAL_CHECK_OUTPUT\nprofile = nbddp.profile()\nprint(list(profile.columns))\n"
             "waits = profile.set_index('rank').wait_s\n"
             "print('rank 0 waited at least 0.3 s more than rank 1 over 10 steps:', bool(waits[0] - waits[1] >= 0.3))"),
    ],
    "13-when-a-rank-is-lost.ipynb": [
        md("# When a rank is lost: the pool heals itself\n\nA pool's worth is its state: a model, its optimizer, the "
           "data, built once in the ranks. When a rank dies (the out-of-memory killer, a `kill -9`, a segfault in an "
           "extension), nbddp says so at once and mends the pool: a replacement with the same rank number takes the "
           "state its peers agree on from one of them, every rank joins a new process group, and the DDP model is "
           "made anew on it. The next cell goes on as if nothing happened, except for names made from `rank`, "
           "which the replacement never gets from a peer: the cell lists them, to run again."),
        code("%load_ext nbddp\nimport os, signal, torch\n"
             "torch.manual_seed(0)\nX = torch.randn(6000, 8)\nY = X @ torch.randn(8, 1) + 0.1 * torch.randn(6000, 1)"),
        md("Three ranks (`--on-loss heal` is the default: `shrink` goes on with the survivors, `end` ends the pool). "
           "Healing needs two survivors to agree on a value before it is copied: a pool of 2 has one survivor, whose "
           "names the replacement then lacks (listed, to run again)."),
        code("%ddp start --devices 3 --seed 0"),
        code("%%ddp\n"
             "from torch.nn.parallel import DistributedDataParallel as DDP\n"
             "model = DDP(torch.nn.Linear(8, 1))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "x, y = X[rank::world_size], Y[rank::world_size]   # each rank's own shard: made from rank\n"
             "def train(steps):\n"
             "    for _ in range(steps):\n"
             "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
             "        opt.zero_grad(); loss.backward(); opt.step()\n"
             "    return loss.item()\n"
             "loss = train(20)\n"
             "if rank == 0:\n"
             "    print(f'loss after 20 steps: {loss:.4f}')"),
        md("Now rank 2 dies as the out-of-memory killer would kill it. Between cells nbddp watches the ranks on the "
           "kernel's own event loop: the pool's view above says `rank 2 lost while idle: killed by SIGKILL`, then "
           "`healing`, then `healed`, with the times, before any cell runs."),
        code("%%ddp --gather pid\npid = os.getpid()"),
        code("import select\n"
             "gone = os.pidfd_open(pid[2])\n"
             "os.kill(pid[2], signal.SIGKILL)\n"
             "select.select([gone], [], [], 10)   # until it has died, as nbddp's watch sees it\n"
             "os.close(gone)"),
        md("The next cell says what healing did. `model`, `opt`, `train` came from rank 0; `x` and `y` differ "
           "between ranks, so rank 2 lacks them and the message names the cell that made them. Make them again and "
           "train on: the replicas stay equal."),
        code("%%ddp\n"
             "x, y = X[rank::world_size], Y[rank::world_size]\n"
             "loss = train(20)\n"
             "if rank == 0:\n"
             "    print(f'loss after 40 steps: {loss:.4f}')"),
        code("%%ddp --gather w\nw = model.module.weight.detach().clone()"),
        code("# NBVAL_CHECK_OUTPUT\nprint('every rank holds the same weights:', all(torch.equal(w[0], v) for v in w))"),
        md("`%ddp resize N` grows or shrinks a live pool the same way: new ranks take the state from rank 0, a "
           "shrink lets the highest ranks go. Names made from the old rank numbers or world size are listed."),
        code("%ddp resize 2"),
        code("%%ddp\n"
             "x, y = X[rank::world_size], Y[rank::world_size]\n"
             "loss = train(20)\n"
             "if rank == 0:\n"
             "    print(f'loss after 60 steps on {world_size} ranks: {loss:.4f}')"),
        code("%ddp stop"),
    ],
    "14-when-the-kernel-restarts.ipynb": [
        md("# When the kernel restarts: the pool lives on\n\nA pool's ranks hold what took time to build: a model, "
           "its optimizer, data, a training hours in. By default, if the notebook's kernel is **killed** (the "
           "out-of-memory killer, a crash, Jupyter's restarter after one), the pool does not die with it: a small "
           "keeper process holds it for 10 minutes, its ranks and their state as they were, a `--bg` training going "
           "on. The next kernel's `%load_ext nbddp` says so, and `%ddp attach` (or \"Run All\", whose `%ddp start` "
           "with the same options takes it) carries on where the last kernel stopped.\n\n"
           "A **deliberate** restart or shutdown (Kernel → Restart) ends the pool, freeing its devices, unless it was "
           "started with `--keep DURATION` (`30s`, `10m`, `2h`): then it waits that long across any end of its "
           "kernel. `--keep off`: the pool always ends with its kernel."),
        code("%load_ext nbddp\nimport torch"),
        code("%ddp start --devices 2 --keep 5m"),
        code("%%ddp\n"
             "from torch.nn.parallel import DistributedDataParallel as DDP\n"
             "torch.manual_seed(0)\n"
             "model = DDP(torch.nn.Linear(8, 1))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
             "x = torch.randn(512, 8)\n"
             "y = x.sum(1, keepdim=True)\n"
             "def train(steps):\n"
             "    for _ in range(steps):\n"
             "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
             "        opt.zero_grad(); loss.backward(); opt.step()\n"
             "    return loss.item()\n"
             "loss = train(50)\n"
             "if rank == 0:\n"
             "    print(f'loss after 50 steps: {loss:.4f}')"),
        md("## The kernel goes away\n\nA notebook cannot kill its own kernel and go on running, so this one lets go "
           "of its pool with `%ddp detach`, which hands it to its keeper exactly as a killed kernel's end does: "
           "nothing in the ranks stops. (In your own notebook, try Kernel → Restart on a pool started with "
           "`--keep 5m`, or kill the kernel's process.) `%ddp pools` lists the kept pools of this user on this "
           "machine: their devices, the notebook that started them, the names their ranks hold, a cell running in "
           "them, and how long they wait."),
        code("%ddp detach"),
        code("%ddp pools"),
        md("## The next kernel takes it\n\n`%ddp attach` takes the only pool waiting (`%ddp attach ID` one of "
           "several; `%ddp stop ID` ends one without taking it). The ranks are the same processes, so everything "
           "they held is there: the training goes on from step 50. Names of the new kernel's a cell reads are sent "
           "to the ranks as they would be to any pool."),
        code("%ddp attach"),
        code("steps = 50   # a name of this kernel's, sent to the ranks when a cell reads it"),
        code("%%ddp --gather w\n"
             "loss = train(steps)\n"
             "if rank == 0:\n"
             "    print(f'loss after 100 steps: {loss:.4f}')\n"
             "w = model.module.weight.detach().clone()"),
        code("# NBVAL_CHECK_OUTPUT\nprint('every rank holds the same weights:', torch.equal(w[0], w[1]))"),
        md("A `--bg` training sent before the kernel died goes on meanwhile; what it prints and logs with "
           "`nbddp.log` is kept (its rank logs have every line; `nbddp.metrics()` in the next kernel has every step). "
           "A cell the dead kernel was running in the foreground is interrupted in the ranks, as Jupyter's interrupt "
           "would: nobody waits for it any more. Only you can reach your kept pools: the keeper listens on a socket "
           "in a directory only your user can open and checks every caller's user id. See the user guide, \"When "
           "the kernel restarts\"."),
        code("%ddp stop"),
    ],
}


# what a saved output must not hold: it would tie the notebook to the machine that built it (strict nbval
# fails everywhere else) or show a third-party library's noise as the tutorial's output
MACHINE = re.compile(r"(?<![\w.~])/(?:home|work|tmp|root|usr|opt|var|private|Users)/[^\s'\"<>]*|\S*site-packages\S*")
WARNING = re.compile(r"\b\w*Warning: ")


def outputs_text(cell) -> str:
    """Every saved output of ``cell`` as text (streams, data of each MIME type, tracebacks)."""
    import json

    return "\n".join(json.dumps(o, ensure_ascii=False) for o in cell.get("outputs", []))


def without_home(nb) -> None:
    """This user's home spelled ``~`` (nbddp's run directories are under it: ``~/.cache/nbddp/runs``), as
    the reader reads it and whoever rebuilds the notebook writes it."""
    home = str(Path.home())
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            _replace_in(out, home + "/", "~/")


def _replace_in(node, old: str, new: str):
    if isinstance(node, dict):
        for k, v in node.items():
            node[k] = _replace_in(v, old, new)
    elif isinstance(node, list):
        node[:] = [_replace_in(v, old, new) for v in node]
    elif isinstance(node, str):
        return node.replace(old, new)
    return node


def machine_bound(nb) -> list[str]:
    """The outputs that name this machine's paths or carry a library's warning: (cell, what) as text."""
    found = []
    for i, cell in enumerate(nb.cells):
        text = outputs_text(cell)
        for hit in [*MACHINE.findall(text), *WARNING.findall(text)]:
            found.append(f"cell {i}: {hit[:160]}")
    return found


def main(names):
    if names[:1] == ["--scrub"]:  # saved notebooks, not run again: the home directory as ~, then the check
        for path in [HERE / n for n in names[1:]] or sorted(HERE.glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            without_home(nb)
            bad = machine_bound(nb)
            if bad:
                sys.exit(f"{path.name}: saved outputs tie it to this machine:\n" + "\n".join(bad))
            nbformat.write(nb, path)
        return
    for name, cells in NOTEBOOKS.items():
        if names and name not in names:
            continue
        nb = nbformat.v4.new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(HERE)}}).execute()
        for cell in nb.cells:
            errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
            if errors and "NBVAL_RAISES_EXCEPTION" not in cell.source:
                sys.exit(f"{name}: unexpected error in cell:\n{cell.source}\n{errors[0].ename}: {errors[0].evalue}")
        without_home(nb)
        bad = machine_bound(nb)
        if bad:  # fix the cause in the cell (a deprecated import, a library's logging), then build again
            sys.exit(f"{name}: not saved: outputs tie it to this machine or show a library's warning:\n" + "\n".join(bad))
        nbformat.write(nb, HERE / name)
        print("wrote", name)


if __name__ == "__main__":
    main(sys.argv[1:])
