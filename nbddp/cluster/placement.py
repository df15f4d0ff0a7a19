"""In the kernel: the Ray cluster a pool spans, and where its ranks go.

``connect``: the Ray cluster the notebook is connected to (``ray.init(address=...)``), or the one
``--cluster ray:ADDRESS`` names; a Ray Client connection (``ray://``) is refused, since an agent's
forked ranks must reach the kernel's node directly (gloo, NCCL) and the client proxies only Ray calls.
``reserve``: one placement-group bundle per node (``STRICT_SPREAD``: N distinct nodes), the first pinned
to the kernel's node; a bundle holds the node's ranks' devices (D GPUs, or D CPUs for CPU ranks), so Ray's
accounting sees them. ``agents``: one agent actor (agent.py) per other node: a CPU pool's kept for the
kernel's next pool there, a GPU pool's in its node's bundle.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from .. import timeline
from ..errors import UsageError

READY_S = 60.0  # the placement group must be placed by then
START_S = 120.0  # every agent must have forked its ranks by then
PREFER_S = 1.0  # ... on the nodes where agents are kept, if it can be there by then (else anywhere)
NEED_RAY = ("--cluster ray needs Ray in the kernel and on every node: pip install 'nbddp[ray]' (the same "
            "versions of Python, torch, Ray and nbddp everywhere).")


@dataclass
class Node:
    index: int  # node rank: 0 is the kernel's
    node_id: str
    ip: str
    host: str = ""

    @property
    def label(self) -> str:
        return f"{self.index} ({self.host or self.ip}, ray {self.node_id[:8]})"


def connect(cluster: str):
    """The ``ray`` module, connected. ``cluster``: "ray" (the notebook's connection, else RAY_ADDRESS or
    the cluster this machine is part of) or "ray:ADDRESS"."""
    address = cluster.partition(":")[2] or None
    if (address or os.environ.get("RAY_ADDRESS", "")).startswith("ray://"):
        raise UsageError(client_refusal(address or os.environ["RAY_ADDRESS"]))
    try:
        import ray
    except ImportError:
        raise UsageError(NEED_RAY) from None
    if ray.is_initialized():
        if _client_mode(ray):
            raise UsageError(client_refusal("this notebook's ray.init(\"ray://...\")"))
        joined = ray.get_runtime_context().gcs_address
        if address and address != "auto" and _resolved(address) != _resolved(joined):
            raise UsageError(f"--cluster {cluster}: this kernel is already connected to the Ray cluster at {joined}, "
                             "and a process joins one Ray cluster only. Use --cluster ray for that one, or "
                             "ray.shutdown() first. Nothing ran.")
        return ray
    try:
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    except ConnectionError as e:
        raise UsageError(f"--cluster {cluster}: no Ray cluster to join ({e}).\nStart one (`ray start --head` here, "
                         "`ray start --address HEAD:6379` on the other nodes), or connect the notebook first with "
                         "ray.init(address=...). Nothing ran.") from None
    return ray


def _resolved(address: str) -> str:
    """HOST:PORT with the host as an IP address (the port 6379 if none)."""
    host, _, port = address.rpartition(":") if ":" in address else (address, "", "6379")
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass  # compared as written
    return f"{host}:{port}"


def client_refusal(address: str) -> str:
    return (f"{address}: a Ray Client connection (ray://) cannot host a pool. The kernel forks its node's ranks "
            "and they exchange tensors with the other nodes' ranks directly (gloo/NCCL), so the kernel must run "
            "on a node of the cluster. Run the notebook on a cluster node and connect with "
            "ray.init(address='auto') or --cluster ray:HEAD_IP:6379. Nothing ran.")


def _client_mode(ray) -> bool:
    try:
        return ray.util.client.ray.is_connected()
    except Exception:  # noqa: BLE001 - not a Ray client, or a Ray without one: a direct driver
        return False


def reserve(ray, nodes: int, per_node: int, accelerator: str):
    """(placement group, [Node] in node-rank order): one bundle per node, node 0 the kernel's; the other
    bundles on nodes where an agent is kept for this kernel (placement.agents) when they have the room
    (tried for ``PREFER_S``), so that a later pool finds its agents."""
    me = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) < nodes:
        raise UsageError(f"--nodes {nodes}: the Ray cluster has {len(alive)} node(s) alive. Add nodes (ray start "
                         f"--address ...), or ask for --nodes {len(alive)}. Nothing ran.")
    bundle = bundle_for(per_node, accelerator)
    job, up = ray.get_runtime_context().get_job_id(), {n["NodeID"] for n in alive}
    kept = sorted(node for j, node in KEPT if j == job and node in up and node != me)[:nodes - 1]
    pg = None
    if accelerator != "cuda" and nodes > 1 and len(kept) == nodes - 1 and len(alive) > nodes:
        pg = _placed(ray, [bundle] * nodes, [{"ray.io/node-id": node} for node in (me, *kept)], PREFER_S)
    pg = pg or _placed(ray, [bundle] * nodes, [{"ray.io/node-id": me}] + [{}] * (nodes - 1), READY_S)
    if pg is None:
        have = [f"{n['NodeManagerAddress']} ({_resources(n)})" for n in alive]
        raise UsageError(f"--nodes {nodes} --devices {per_node}: Ray could not place {bundle} on {nodes} different "
                         f"nodes (this kernel's among them) within {READY_S:g} s. Nodes alive: {'; '.join(have)}. "
                         "Nothing ran.")
    from ray.util.placement_group import placement_group_table

    found = False
    try:
        where = placement_group_table(pg)["bundles_to_node_id"]
        found = True
    finally:
        if not found:  # whatever stopped it, an interrupt too: the group released
            release(pg)
    by_id = {n["NodeID"]: n for n in alive}
    out = [Node(i, where[i], by_id.get(where[i], {}).get("NodeManagerAddress", "?")) for i in range(nodes)]
    out[0].host = socket.gethostname()
    return pg, out


def bundle_for(per_node: int, accelerator: str) -> dict:
    """What each node's bundle holds: its ranks' GPUs, or CPUs."""
    return {"GPU": per_node} if accelerator == "cuda" else {"CPU": per_node}


def _placed(ray, bundles: list, selectors: list, within: float):
    """A STRICT_SPREAD group of ``bundles``, placed within ``within`` seconds (None: it was not, and is gone)."""
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy="STRICT_SPREAD", bundle_label_selector=selectors)
    ready = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=within)
    finally:
        if not ready:  # not placed in time, or an interrupt while it is placed: it must not outlive the attempt
            release(pg)
    return pg if ready else None


def release(pg) -> None:
    """The placement group removed (with whatever still runs in it)."""
    from ray.util.placement_group import remove_placement_group

    _gone_or_ended(lambda: remove_placement_group(pg))


def _gone_or_ended(call) -> None:
    """``call()``, a Ray call that ends a group or an agent: one that fails found it gone already."""
    try:
        call()
    except Exception:  # noqa: BLE001 - Ray's errors are many: the group or agent is gone already, or Ray with it
        pass


def _resources(n: dict) -> str:
    r = n.get("Resources", {})
    return ", ".join(f"{k} {r[k]:g}" for k in ("CPU", "GPU") if k in r) or "no CPU or GPU"


KEPT: dict[tuple[str, str], object] = {}  # (Ray job, node id) -> the agent kept there between this kernel's pools


def agents(ray, pg, nodes: list, per_node: int, accelerator: str) -> list:
    """One agent actor per other node (owned by the kernel: Ray ends them if the kernel dies).

    A CPU pool's agent is kept between the kernel's pools (``KEPT``; placed on its node, holding none of
    the bundle's resources, which stay reserved by the group for the ranks): the next pool on that node
    finds it with torch imported, and starts in a fraction of a second instead of a Ray worker's start plus
    torch's import. A GPU pool's agent sits in its bundle (Ray gives it the bundle's GPUs, its ranks' devices)
    and ends with its pool."""
    from ray.util.scheduling_strategies import (
        PlacementGroupSchedulingStrategy,
    )

    from .agent import Agent

    actor = ray.remote(Agent)
    if accelerator == "cuda":
        return [actor.options(num_gpus=per_node, num_cpus=0, max_concurrency=8, max_restarts=0,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  pg, placement_group_bundle_index=n.index)).remote() for n in nodes[1:]]
    job = ray.get_runtime_context().get_job_id()
    kept = {n.node_id: KEPT[job, n.node_id] for n in nodes[1:] if (job, n.node_id) in KEPT}
    for node_id, dead in _dead(ray, kept).items():  # ended between pools (its node lost, killed)
        forget(dead)
        del kept[node_id]
    return [kept.get(n.node_id) or _keep(ray, actor, job, n.node_id) for n in nodes[1:]]


def moved(ray, pg, lost: Node, used: list, bundle: dict, within: float):
    """(node, placement group, bundle index) for the ranks of ``lost``, whose agent is gone: its bundle's node if
    that is alive (the agent alone was lost: killed, hung, its stream broken), or where Ray moved the bundle
    (it moves a dead node's bundles to a node with the room, unless the bundle is pinned to its node, as one
    placed where an agent was kept is), else a group of its own (``bundle``) on a node that is none of
    ``used`` (the pool's node ids), the caller's to release; None if no node has the room within ``within`` s."""
    from ray.util.placement_group import placement_group_table

    end = time.monotonic() + within
    moved_by = min(end, time.monotonic() + timeline.MOVED_S)
    while True:
        node_id = placement_group_table(pg)["bundles_to_node_id"].get(lost.index)
        alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        if node_id and node_id in alive:
            return Node(lost.index, node_id, alive[node_id].get("NodeManagerAddress", "?")), pg, lost.index
        if time.monotonic() >= moved_by:
            break
        time.sleep(0.2)
    return room(ray, lost.index, used, bundle, max(0.0, end - time.monotonic()))


def room(ray, index: int, used: list, bundle: dict, within: float):
    """(node, placement group, 0): a group of its own (``bundle``, the caller's to release) on a node that is none
    of ``used`` (the pool's node ids), to be the pool's node ``index``; None if none has the room within
    ``within`` s."""
    from ray.util.placement_group import placement_group_table

    own = _placed(ray, [bundle], [{"ray.io/node-id": f"!in({','.join(used)})"}], within)
    if own is None:
        return None
    node_id = placement_group_table(own)["bundles_to_node_id"][0]
    ip = next((n.get("NodeManagerAddress", "?") for n in ray.nodes() if n["NodeID"] == node_id), "?")
    return Node(index, node_id, ip), own, 0


def _keep(ray, actor, job: str, node_id: str):
    """A new agent on ``node_id``, kept for the kernel's pools."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for key in [k for k in KEPT if k[0] != job]:  # another Ray connection's: gone with it
        del KEPT[key]
    KEPT[job, node_id] = actor.options(num_cpus=0, max_concurrency=8, max_restarts=0,
                                       scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    return KEPT[job, node_id]


def prestart(cluster: str = "ray") -> int:
    """Start a kept agent on every other node of the Ray cluster now, without waiting for it, so that the
    kernel's first CPU pool finds them with torch imported (call it after ``ray.init``: their ~3 s then pass
    while the notebook does other work). How many were started (nodes that had one already are skipped)."""
    from .agent import Agent

    ray = connect(cluster)
    me, job = ray.get_runtime_context().get_node_id(), ray.get_runtime_context().get_job_id()
    actor = ray.remote(Agent)
    fresh = [n["NodeID"] for n in ray.nodes()
             if n.get("Alive") and n["NodeID"] != me and (job, n["NodeID"]) not in KEPT]
    for node_id in fresh:
        _keep(ray, actor, job, node_id)
    return len(fresh)


def _dead(ray, kept: dict) -> dict:
    """The kept agents that no longer answer (node id -> agent): one call each, answered in ~1 ms."""
    refs = {node_id: a.where.remote() for node_id, a in kept.items()}
    dead = {}
    for node_id, ref in refs.items():
        try:
            ray.get(ref, timeout=READY_S)
        except Exception:  # noqa: BLE001 - RayActorError, GetTimeoutError: start a fresh one
            dead[node_id] = kept[node_id]
    return dead


def is_kept(actor) -> bool:
    return any(a is actor for a in KEPT.values())


def forget(actor, ray=None) -> None:
    """``actor`` no longer kept (killed too, when ``ray`` is given)."""
    for key in [k for k, a in KEPT.items() if a is actor]:
        del KEPT[key]
    if ray is not None:
        _gone_or_ended(lambda: ray.kill(actor))


def release_agents() -> int:
    """End the agents this kernel keeps between pools (each holds a Ray worker with torch imported on its
    node); the next pool starts fresh ones. How many there were."""
    import ray

    kept = list(KEPT.values())
    for actor in kept:
        forget(actor, ray)
    return len(kept)


def no_interface(ip: str, where: str) -> str:
    """Why a pool cannot pin its collective traffic on ``where``, whose Ray address is ``ip``."""
    return (f"{where}: its Ray address {ip} is on none of its network interfaces, so nbddp cannot tell gloo/NCCL "
            "which interface the other nodes reach it on (left to guess, gloo may advertise an address such as "
            "127.0.1.1 and the rendezvous hangs). Set NBDDP_IFNAME in the kernel's environment to that interface "
            "(e.g. os.environ['NBDDP_IFNAME'] = 'eth0'; `ip -br addr` lists them), then %ddp start again. "
            "Nothing ran.")
