"""``nbddp demo``: a real %%ddp notebook (CPU, 2 gloo ranks) executed headless in a fresh kernel,
its output streamed to this terminal as the cells produce it."""
from __future__ import annotations

import queue
import sys
import time

CELLS = [
    "%load_ext nbddp\n"
    "import torch\n"
    "torch.manual_seed(0)\n"
    "X = torch.randn(200_000, 32)                  # built once in the notebook, shared copy-on-write\n"
    "Y = X @ torch.randn(32, 1) + 0.01 * torch.randn(200_000, 1)\n"
    "import nbddp\n"
    "print(nbddp.environment())",
    "%%ddp --devices 2 --accelerator cpu --out state\n"
    "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1).to(device))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "x, y = X[rank::world_size], Y[rank::world_size]   # each rank trains on its shard\n"
    "for epoch in range(5):\n"
    "    for i in range(0, len(x), 10_000):\n"
    "        opt.zero_grad()\n"
    "        loss = torch.nn.functional.mse_loss(model(x[i:i + 10_000]), y[i:i + 10_000])\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "    print(f'epoch {epoch} loss {loss.item():.4f}')\n"
    "state = model.module.state_dict()\n"
    "loss.item()",
    "print('back in the notebook:', {k: tuple(v.shape) for k, v in state.items()})",
]


def main() -> int:
    import tempfile

    from jupyter_client import KernelManager

    # the kernel is this process's own, on this machine: its sockets are files in a private (0700) temp
    # directory (IPC transport), not TCP ports, so ipykernel has no "running over TCP without encryption"
    # warning to print into the demo's output, where it would read as nbddp's; its real errors still show
    with tempfile.TemporaryDirectory(prefix="nbddp-demo-") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=f"{sockets}/kernel")
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        failed = False
        try:
            kc.wait_for_ready(timeout=60)
            for n, code in enumerate(CELLS, 1):
                print(f"\n\x1b[1mIn [{n}]:\x1b[0m " + code.replace("\n", "\n        "))
                failed |= _run(kc, code, timeout=300)
                if failed:
                    break
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    return 1 if failed else 0


def _run(kc, code: str, timeout: float) -> bool:
    msg_id = kc.execute(code)
    deadline = time.monotonic() + timeout
    failed = False
    live: dict[str, str] = {}  # display id -> its latest text (the dashboard): a terminal shows its final state
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            (sys.stderr if content["name"] == "stderr" else sys.stdout).write(content["text"])
        elif kind == "execute_result":
            print(f"Out: {content['data'].get('text/plain')}")
        elif kind in ("display_data", "update_display_data") and content.get("transient", {}).get("display_id"):
            live[content["transient"]["display_id"]] = content["data"].get("text/plain", "")
        elif kind == "display_data" and "text/plain" in content["data"] and "text/html" in content["data"]:
            print(content["data"]["text/plain"])
        elif kind == "error":
            print("\n".join(content["traceback"]), file=sys.stderr)
            failed = True
        elif kind == "status" and content["execution_state"] == "idle":
            for text in live.values():
                print(text)
            return failed
    print(f"cell did not finish within {timeout}s", file=sys.stderr)
    return True
