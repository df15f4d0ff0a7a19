"""Code users already run works inside %%ddp unchanged: TorchMetrics, Lightning, Accelerate."""

import pytest

from kernel import said

pytestmark = pytest.mark.timeout(240)


def test_torchmetrics_syncs_across_ranks(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\nimport torchmetrics\n"
        "metric = torchmetrics.MeanMetric()\n"
        "metric.update(torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([6.0, 7.0, 9.0]))\n"
        "print(f'global mean {metric.compute().item():.2f}')\n",
        timeout=120,
    )
    assert said(res.stdout, 0, "global mean 5.00") and said(res.stdout, 1, "global mean 5.00"), res.stdout


LIGHTNING = """%%ddp --devices 2 -o weights
import psutil, pytorch_lightning as pl, torch.distributed as dist
class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
torch.manual_seed(rank)  # different initial weights per rank: DDP must sync them
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = Regression()
trainer.fit(model, loader)
print(f"lightning world {trainer.world_size} rank {trainer.global_rank} "
      f"processes {len(psutil.Process(os.getppid()).children())}")
w = model.layer.weight.detach().clone()
others = [torch.zeros_like(w) for _ in range(world_size)]
dist.all_gather(others, w)
print("in sync", all(torch.equal(o, others[0]) for o in others))
weights = w
"""


def test_lightning_trainer_ddp_runs_as_the_ranks(clean_kernel):
    k = clean_kernel
    k.ok("import pytorch_lightning  # imported in the notebook first: Lightning then believes it is interactive")
    res = k.ok(LIGHTNING, timeout=200)
    for r in (0, 1):
        assert f"[rank{r}]:lightning world 2 rank {r} processes 2" in res.stdout, res.stdout + res.stderr
        assert said(res.stdout, r, "in sync True")
    assert k.value("tuple(weights.shape)") == (1, 4)


def test_accelerate_sees_the_ranks(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\nfrom accelerate import Accelerator\nacc = Accelerator(cpu=True)\n"
        "print(f'processes {acc.num_processes} index {acc.process_index} main {acc.is_main_process}')\n"
        "total = acc.reduce(torch.tensor([rank + 1.0]), reduction='sum')\nprint(f'reduced {total.item()}')\n",
        timeout=120,
    )
    assert "[rank0]:processes 2 index 0 main True" in res.stdout, res.stdout + res.stderr
    assert "[rank1]:processes 2 index 1 main False" in res.stdout
    assert said(res.stdout, 0, "reduced 3.0") and said(res.stdout, 1, "reduced 3.0")


# -- library state made in the notebook (issue 21, point 2) -----------------------------------------
HF_SETUP = """
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

def tiny_bert():  # a random BERT from a config: no download
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

class Toy(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 64, (n, 8), generator=g)
        self.y = self.x.sum(1) % 2
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}
"""


def hf_args(out, more: str = "save_strategy='no'") -> str:
    return (f"TrainingArguments(output_dir={str(out)!r}, per_device_train_batch_size=4, num_train_epochs=1, "
            f"logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0, {more})")


HF_FIT = """
trainer = Trainer(model=tiny_bert(), args=args, train_dataset=Toy())
trainer.train()
summary = (trainer.state.global_step, [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h],
           trainer.args.world_size, trainer.args.process_index, type(trainer.model_wrapped).__name__)
"""


def test_training_arguments_made_in_the_notebook_train_as_if_made_in_the_cell(clean_kernel, tmp_path):
    """TrainingArguments resolves device and accelerate's PartialState when made, and caches them: made in
    the notebook (world size 1), each rank would train everything, unwrapped. The same steps and losses
    whether made in the cell or the notebook, one-shot and in a pool (forked with it, or sent by pickle)."""
    k = clean_kernel
    k.ok(HF_SETUP, timeout=120)
    in_cell = k.ok(f"%%ddp --devices 2 --out summary\nargs = {hf_args(tmp_path / 'a')}\n{HF_FIT}", timeout=200)
    expected = k.value("summary")
    assert expected[0] == 4 and len(expected[1]) == 4 and expected[2:] == (2, 0, "DistributedDataParallel"), \
        in_cell.stdout + in_cell.stderr
    k.ok(f"args = {hf_args(tmp_path / 'b')}\nprint(args.world_size, args.parallel_mode)")
    one_shot = k.ok(f"%%ddp --devices 2 --out summary\n{HF_FIT}", timeout=200)
    assert k.value("summary") == expected, one_shot.stdout + one_shot.stderr
    assert "nbddp:" not in one_shot.stderr  # nothing stale to name: nbddp made it the rank's own
    k.ok("made = Trainer(model=tiny_bert(), args=args, train_dataset=Toy())")  # a Trainer: named, not fixed
    named = k.ok("%%ddp --devices 2\nmade.train()", timeout=200)
    assert "[rank0]:nbddp: `made` (a transformers Trainer made in the notebook) has world size 1, but this cell " \
           "runs on 2 ranks" in named.stderr
    k.ok("%ddp start --devices 2", timeout=120)
    try:
        k.ok(f"%%ddp --out summary\n{HF_FIT}", timeout=200)  # forked with the pool
        assert k.value("summary") == expected
        k.ok(f"args = {hf_args(tmp_path / 'c')}")  # made after the pool started: it arrives pickled
        sent = k.ok(f"%%ddp --out summary\n{HF_FIT}", timeout=200)
        assert "sent args" in sent.stdout + sent.stderr and k.value("summary") == expected
    finally:
        k.ok("%ddp stop", timeout=60)


def test_accelerate_and_rank_zero_state_made_in_the_notebook_is_the_ranks(clean_kernel):
    k = clean_kernel
    k.ok("from accelerate import Accelerator, PartialState\nimport torchmetrics, pytorch_lightning\n"
         "acc = Accelerator(cpu=True)\nstate = PartialState()\nprint(acc.num_processes, state.process_index)")
    res = k.ok(
        "%%ddp --devices 2\n"
        "from lightning_utilities.core.rank_zero import rank_zero_only\n"
        "from torchmetrics.utilities.prints import rank_zero_only as metrics_rank_zero_only\n"
        "model = acc.prepare(torch.nn.Linear(2, 1))\n"
        "total = acc.reduce(torch.tensor([rank + 1.0]), reduction='sum').item()\n"
        "print('world', acc.num_processes, 'index', acc.process_index, state.process_index, type(model).__name__,\n"
        "      'sum', total, 'rank_zero_only', rank_zero_only.rank, metrics_rank_zero_only.rank)\n",
        timeout=120)
    for r in (0, 1):
        assert f"[rank{r}]:world 2 index {r} {r} DistributedDataParallel sum 3.0 rank_zero_only {r} {r}" \
               in res.stdout, res.stdout + res.stderr


def test_an_object_nbddp_cannot_fix_is_named_with_the_fix(clean_kernel):
    k = clean_kernel
    k.ok("import lightning_fabric\nfabric = lightning_fabric.Fabric(accelerator='cpu', devices=1)")
    quiet = k.ok("%%ddp --devices 2\nprint('fabric not read here')")
    assert "fabric" not in quiet.stderr
    own = k.ok("%%ddp --devices 2\nfabric = lightning_fabric.Fabric(accelerator='cpu', devices=1)\nfabric.world_size")
    assert "nbddp:" not in own.stderr  # made in the cell: the rank's own, whatever it says
    res = k.ok("%%ddp --devices 2\nprint('world', fabric.world_size)")
    assert "[rank0]:nbddp: `fabric` (a lightning_fabric Fabric made in the notebook) has world size 1, but this " \
           "cell runs on 2 ranks, and nbddp cannot make it the rank's own: make it inside the %%ddp cell" in res.stderr
    assert "[rank1]:nbddp" not in res.stderr
