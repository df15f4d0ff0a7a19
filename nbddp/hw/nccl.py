"""The NCCL seam: environment a GPU rank needs so NCCL stays on this machine and on loopback."""
from __future__ import annotations


def rank_env(loopback_ifname: str) -> dict[str, str]:
    """Environment for a single-machine NCCL job.

    NCCL's bootstrap sockets go to loopback; data moves over NVLink/PCIe P2P or shared memory, which
    NCCL picks by itself. ``NCCL_ASYNC_ERROR_HANDLING``/``TORCH_NCCL_ASYNC_ERROR_HANDLING`` makes a
    collective whose peer died raise instead of hanging. Users' own settings win (Kaggle's 2xT4 often
    needs ``NCCL_P2P_DISABLE=1``; see docs/environments.md).
    """
    return {
        "NCCL_SOCKET_IFNAME": loopback_ifname,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
