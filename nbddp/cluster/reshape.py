"""In the kernel: a pool across Ray nodes renumbered (it shrank: ``--on-loss shrink``, ``%ddp resize`` to fewer).

Rank numbers go node by node, the kernel's node first. After a shrink, the survivors keep their order: each
node's agent renumbers its ranks before any command for their new numbers reaches it (an agent applies the
kernel's calls in order), a node left with no rank is let go (its agent's stream ends), and each rank is told
its new place as torchrun would say it (``node_place``): its place among its node's ranks, its node's among
the nodes that still have any (the kernel's node may have none left).
"""
from __future__ import annotations

import dataclasses

from ..rank.worker import place_env


def node_place(rank: int, world_size: int, local: int, on_node: int, node: int, nodes: int) -> dict:
    """The environment that says a rank's place in a pool across nodes (torchrun's names): ``local``, its place
    among the ``on_node`` ranks of its node; ``node``, its node's among the ``nodes``."""
    return {**place_env(rank, world_size), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(on_node),
            "GROUP_RANK": str(node), "NODE_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes)}


def layout(gang) -> list[list[int]]:
    """The ranks of each node that has any, in node order (the kernel's first)."""
    nodes = [sorted(gang._cmd)] + [sorted(link.ranks) for link in gang.links]
    return [ranks for ranks in nodes if ranks]


def place(gang, rank: int) -> dict:
    """``rank``'s place (its environment) in the gang as it is now."""
    nodes = layout(gang)
    node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    return node_place(rank, gang.world_size, nodes[node].index(rank), len(nodes[node]), node, len(nodes))


def renumber(gang, moves: dict) -> None:
    """The other nodes' side of ``Gang.renumber`` (old rank -> new), before it: each agent told, its link's
    ranks, the streams' records, the node names and the values owed renumbered."""
    for link in gang.links:
        mine = {r: moves[r] for r in link.ranks if r in moves}
        if mine:
            link.control("renumber", mine)
        elif link.ranks:
            link.control("finish")
        link.ranks = sorted(mine.values())
    gang.streams.procs = {moves[r]: p for r, p in gang.streams.procs.items() if r in moves}
    gang.node_names = {moves[r]: n for r, n in gang.node_names.items() if r in moves}
    gang.given = {moves[r] for r in gang.given if r in moves}


def placed_anew(gang) -> None:
    """After ``Gang.renumber``: each rank's spec says its new place (a replacement forked later starts there)."""
    for rank, spec in gang.specs.items():
        gang.specs[rank] = dataclasses.replace(spec, env={**spec.env, **place(gang, rank)})
