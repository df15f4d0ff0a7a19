"""The NCCL seam: environment a GPU rank needs so NCCL stays on this machine and on loopback."""
from __future__ import annotations

HOST_NEEDS = {  # session kind -> what NCCL needs there
    # Kaggle's 2xT4 (a VM): NCCL's peer-to-peer path between the two T4s hangs the first collective
    # (Lightning#20523, accelerate#3524); through shared memory it works, and T4s have no NVLink to lose.
    "kaggle": {"NCCL_P2P_DISABLE": "1"},
}


def host_needs(session: str) -> dict[str, str]:
    return dict(HOST_NEEDS.get(session, {}))


def rank_env(loopback_ifname: str, session: str = "") -> dict[str, str]:
    """Environment for a single-machine NCCL job.

    NCCL's bootstrap sockets go to loopback; data moves over NVLink/PCIe P2P or shared memory, which
    NCCL picks by itself. ``NCCL_ASYNC_ERROR_HANDLING``/``TORCH_NCCL_ASYNC_ERROR_HANDLING`` makes a
    collective whose peer died raise instead of hanging. ``session`` (``nbddp.environment().session``)
    adds what that host needs (``HOST_NEEDS``). Users' own settings win (docs/environments.md).
    """
    return {
        "NCCL_SOCKET_IFNAME": loopback_ifname,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        **host_needs(session),
    }
