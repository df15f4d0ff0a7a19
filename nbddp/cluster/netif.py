"""Which network interface carries a node's Ray address: where its ranks' gloo/NCCL traffic goes.

Asked on both sides: by the kernel for its own node (node 0, from the cluster gang) and by each
agent for the node it runs on (``Agent.where``). A module of its own so that the agent, which placement
starts, needs nothing of placement's.
"""
from __future__ import annotations

import socket


def ifname_for(ip: str) -> str | None:
    """The interface that carries ``ip`` on this machine (where the ranks' collective traffic goes)."""
    try:
        import psutil
    except ImportError:  # no psutil
        return None
    try:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
                return name
    except (psutil.Error, OSError):  # no interfaces to read
        pass
    return None
