"""Peers' own distributed test suites pass in a %%ddp cell (issue 10, point 2).

Accelerate's scripts are the ones shipped in its wheel, run unchanged (runpy, as `python script.py`);
each passes under `torchrun --standalone --nproc-per-node 2` with ACCELERATE_USE_CPU=1 (table in
docs/troubleshooting.md). Lightning and FSDP2 + torch.distributed.checkpoint are plain user code."""
from pathlib import Path

import accelerate
import pytest

from kernel import said

pytestmark = pytest.mark.timeout(600)
SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
PASS_UNDER_TORCHRUN = ["test_script.py", "test_ops.py", "test_sync.py"]  # the others: see the table


@pytest.mark.parametrize("script", PASS_UNDER_TORCHRUN)
def test_accelerate_shipped_script_passes_in_a_cell(clean_kernel, script):
    res = clean_kernel.run(
        "%%ddp --devices 2 --timeout 400\n"
        "import os, runpy\nos.environ['ACCELERATE_USE_CPU'] = '1'\n"
        f"runpy.run_path({str(SCRIPTS / script)!r}, run_name='__main__')\n"
        "print('script done', flush=True)\n",
        timeout=450,
    )
    assert res.error is None, res.error_text[-4000:]
    assert said(res.stdout, 0, "script done") and said(res.stdout, 1, "script done"), res.stdout


def test_lightning_ddp_trainer_in_a_cell(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2 --out metrics\n"
        "import pytorch_lightning as pl\n"
        "from pytorch_lightning.demos.boring_classes import BoringModel\n"
        "trainer = pl.Trainer(strategy='ddp', accelerator='cpu', devices=2, max_epochs=2, limit_train_batches=4,\n"
        "                     limit_val_batches=2, logger=False, enable_checkpointing=False,\n"
        "                     enable_progress_bar=False, enable_model_summary=False)\n"
        "trainer.fit(BoringModel())\n"
        "metrics = (trainer.world_size, trainer.global_rank, trainer.current_epoch, trainer.state.finished)\n",
        timeout=240,
    )
    assert clean_kernel.value("metrics") == (2, 0, 2, True), res.stdout


def test_fsdp2_and_distributed_checkpoint_in_a_cell(clean_kernel, tmp_path):
    ckpt = tmp_path / "ckpt"
    res = clean_kernel.ok(
        "%%ddp --devices 2 --out full\n"
        "import torch.distributed as dist\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))\n"
        "for layer in model:\n    if isinstance(layer, torch.nn.Linear):\n        fully_shard(layer)\n"
        "fully_shard(model)\n"
        "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
        "x = torch.randn(64, 16); y = x.sum(1, keepdim=True)\n"
        "for _ in range(20):\n"
        "    opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x[rank::2]), y[rank::2]); loss.backward(); "
                          "opt.step()\n"
        "shard_rows = model[0].weight.to_local().shape[0]\n"
        f"dcp.save({{'model': model.state_dict()}}, checkpoint_id={str(ckpt)!r})\n"
        "restored = {'model': model.state_dict()}\n"
        f"dcp.load(restored, checkpoint_id={str(ckpt)!r})\n"
        "full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
        "print('shard rows', shard_rows, 'loss', round(loss.item(), 3))\n",
        timeout=240,
    )
    assert said(res.stdout, 0, "shard rows 16 ", start=True) and said(res.stdout, 1, "shard rows 16 ", start=True), \
        res.stdout
    assert clean_kernel.value("tuple(full['0.weight'].shape)") == (32, 16)
    assert (ckpt / ".metadata").exists()
