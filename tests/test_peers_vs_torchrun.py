"""The peers' code gives the same numbers in a %%ddp cell as under torchrun (issue 21, point 6).

Each workload below is plain user code, run unchanged in a one-shot `%%ddp --devices 2` cell and in one
`torchrun --standalone --nproc-per-node 2` script (gloo, CPU; one thread per process on both sides:
nbddp's default on two cores, torchrun's OMP_NUM_THREADS=1); every rank's losses, step counts and
weight sums must be equal. transformers' Trainer (a tiny random BERT built from a config: no download),
Lightning Fabric's `ddp`, peft LoRA in DDP, and torch.compile of a DDP model both ways round."""
import json
import time
from pathlib import Path

import pytest

from test_libraries import HF_SETUP, hf_args
from torchrun import torchrun

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

NUMBERS = """
def weight_sum(model):
    return round(sum(p.detach().double().sum().item() for p in model.parameters()), 5)
"""

# with evaluation, a checkpoint at the end of the epoch and a data-loader worker per rank
HF_TRAINER = HF_SETUP + "args = " + hf_args("{out}/hf", "eval_strategy='epoch', save_strategy='epoch', "
                                            "dataloader_num_workers=1") + """
trainer = Trainer(model=tiny_bert(), args=args, train_dataset=Toy(), eval_dataset=Toy(16))
trainer.train()
import os
result = {"steps": trainer.state.global_step, "world": trainer.args.world_size,
          "losses": [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h],
          "eval_loss": [round(h["eval_loss"], 4) for h in trainer.state.log_history if "eval_loss" in h],
          "wrapped": type(trainer.model_wrapped).__name__, "weights": weight_sum(trainer.model),
          "checkpoints": sorted(os.listdir("{out}/hf")) if rank == 0 else None}  # rank 0 writes them
"""

FABRIC = """
import torch
import lightning_fabric
from torch.utils.data import DataLoader, TensorDataset

fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
model, opt = fabric.setup(model, opt)
g = torch.Generator().manual_seed(2)
X = torch.randn(64, 8, generator=g)
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8, shuffle=True))
losses = []
for epoch in range(2):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        losses.append(round(loss.item(), 5))
result = {"losses": losses, "world": fabric.world_size, "rank": fabric.global_rank, "weights": weight_sum(model)}
"""

PEFT_LORA = """
import collections
import torch
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
base = torch.nn.Sequential(collections.OrderedDict(
    fc1=torch.nn.Linear(8, 32), act=torch.nn.ReLU(), fc2=torch.nn.Linear(32, 1)))
lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["fc1", "fc2"]))
model = DDP(lora)
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
g = torch.Generator().manual_seed(3)
X = torch.randn(64, 8, generator=g)
Y = X[:, :1] * 2
losses = []
for step in range(6):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X[rank::world_size]), Y[rank::world_size])
    loss.backward()
    opt.step()
    losses.append(round(loss.item(), 5))
result = {"losses": losses, "trainable": sum(p.numel() for p in lora.parameters() if p.requires_grad),
          "weights": weight_sum(lora)}
"""

COMPILE = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

def compiled_run(wrap):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(4)
    X = torch.randn(32, 8, generator=g)
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X[rank::world_size]), X[rank::world_size, :1])
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 5))
    return losses, weight_sum(net)

torch._dynamo.reset()
torch._dynamo.utils.counters.clear()
result = {"runs": {"compile(DDP(m))": compiled_run(lambda m: torch.compile(DDP(m))),
                   "DDP(compile(m))": compiled_run(lambda m: DDP(torch.compile(m)))},
          "compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0}  # not silently eager
"""

PEERS = {"hf_trainer": HF_TRAINER, "fabric_ddp": FABRIC, "peft_lora": PEFT_LORA, "compile_ddp": COMPILE}

SCRIPT = """
import json, os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
local_rank, device = int(os.environ["LOCAL_RANK"]), torch.device("cpu")
{numbers}
"""


def peer_code(name: str, out: Path) -> str:
    return NUMBERS + PEERS[name].replace("{out}", str(out))


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory):
    """Every workload in one torchrun script (one start, one import of each library): {peer: per-rank
    results}, and the seconds it took."""
    tmp = tmp_path_factory.mktemp("torchrun")
    parts = [SCRIPT.format(numbers=NUMBERS)]
    for name, code in PEERS.items():
        parts.append(code.replace("{out}", str(tmp / "out")))
        parts.append(f"print('RESULT', {name!r}, json.dumps(result), flush=True)\n")
    parts.append("dist.barrier()\ndist.destroy_process_group()\n")
    script = tmp / "peers.py"
    script.write_text("\n".join(parts))
    logs = tmp / "logs"
    t0 = time.monotonic()
    run = torchrun(script, timeout=500, cwd=tmp, log_dir=logs, redirects=3)
    seconds = time.monotonic() - t0
    per_rank = {int(p.parent.name): p for p in logs.rglob("stdout.log")}
    assert run.returncode == 0, run.stderr[-3000:] + "".join(p.read_text()[-3000:] for p in logs.rglob("stderr.log"))
    results: dict = {name: [None, None] for name in PEERS}
    for rank, path in per_rank.items():
        for line in path.read_text().splitlines():
            if line.startswith("RESULT "):
                _, name, data = line.split(" ", 2)
                results[name][rank] = json.loads(data)
    print(f"torchrun, every peer: {seconds:.1f} s")
    return results


@pytest.mark.parametrize("peer", list(PEERS))
def test_the_peers_code_in_a_cell_gives_torchruns_numbers(clean_kernel, under_torchrun, tmp_path, peer):
    t0 = time.monotonic()
    res = clean_kernel.ok(f"%%ddp --devices 2 --gather result\n{peer_code(peer, tmp_path / 'out')}", timeout=400)
    print(f"{peer} in a cell: {time.monotonic() - t0:.1f} s")
    in_cell = json.loads(clean_kernel.ok("import json; print(json.dumps(result))").stdout)
    expected = under_torchrun[peer]
    assert None not in expected, expected
    assert in_cell == expected, (res.stdout[-2000:], res.stderr[-2000:])
    if peer == "hf_trainer":
        assert expected[0]["steps"] == 4 and expected[0]["world"] == 2
        assert expected[0]["wrapped"] == "DistributedDataParallel"
        assert expected[0]["checkpoints"] == ["checkpoint-4"] and len(expected[0]["eval_loss"]) == 1
    if peer == "fabric_ddp":
        assert [r["rank"] for r in expected] == [0, 1] and expected[0]["world"] == 2
    if peer == "compile_ddp":
        assert expected[0]["compiled"] and expected[1]["compiled"]
    synced = [[v[1] for v in r["runs"].values()] if peer == "compile_ddp" else r["weights"] for r in expected]
    assert synced[0] == synced[1]  # DDP kept the ranks' weights equal


def test_the_peers_code_in_a_pool_gives_torchruns_numbers(clean_kernel, under_torchrun, tmp_path):
    """The same workloads one after another in one pool's ranks, as in the one torchrun script."""
    k = clean_kernel
    k.ok("%ddp start --devices 2", timeout=120)
    try:
        for peer in PEERS:
            res = k.ok(f"%%ddp --gather result\n{peer_code(peer, tmp_path / peer)}", timeout=400)
            in_pool = json.loads(k.ok("import json; print(json.dumps(result))").stdout)
            assert in_pool == under_torchrun[peer], (peer, res.stdout[-2000:], res.stderr[-2000:])
    finally:
        k.ok("%ddp stop", timeout=60)
