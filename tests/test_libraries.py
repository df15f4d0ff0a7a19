"""Code users already run works inside %%ddp unchanged: TorchMetrics, Lightning, Accelerate."""
import re

import pytest

pytestmark = pytest.mark.timeout(240)


def test_torchmetrics_syncs_across_ranks(clean_kernel):
    res = clean_kernel.ok(
        "%%ddp --devices 2\nimport torchmetrics\n"
        "metric = torchmetrics.MeanMetric()\n"
        "metric.update(torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([6.0, 7.0, 9.0]))\n"
        "print(f'global mean {metric.compute().item():.2f}')\n",
        timeout=120,
    )
    assert "[rank0]:global mean 5.00" in res.stdout and "[rank1]:global mean 5.00" in res.stdout


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
print(f"lightning world {trainer.world_size} rank {trainer.global_rank} processes {len(psutil.Process(os.getppid()).children())}")
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
        assert f"[rank{r}]:in sync True" in res.stdout
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
    assert len(re.findall(r"reduced 3\.0", res.stdout)) == 2
