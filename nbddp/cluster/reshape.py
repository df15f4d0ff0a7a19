"""In the kernel: a pool across Ray nodes renumbered (it shrank: ``--on-loss shrink``, ``%ddp resize`` to fewer)
or grown (``%ddp resize`` to more: new nodes, ``--devices`` ranks on each, ``grow``).

Rank numbers go node by node, the kernel's node first. After a shrink, the survivors keep their order: each
node's agent renumbers its ranks before any command for their new numbers reaches it (an agent applies the
kernel's calls in order), a node left with no rank is let go (its agent's stream ends), and each rank is told
its new place as torchrun would say it (``node_place``): its place among its node's ranks, its node's among
the nodes that still have any (the kernel's node may have none left).
"""
from __future__ import annotations

import dataclasses
import time

from .. import timeline
from ..errors import UsageError
from ..kernel.ranks.gang import Gang
from ..rank.worker import place_env
from ..wire import agentmessages
from . import placement, relocate, remote


def node_place(rank: int, world_size: int, local: int, on_node: int, node: int, nodes: int) -> dict:
    """The environment that says a rank's place in a pool across nodes (torchrun's names): ``local``, its place
    among the ``on_node`` ranks of its node; ``node``, its node's among the ``nodes``."""
    return {**place_env(rank, world_size), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(on_node),
            "GROUP_RANK": str(node), "NODE_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes)}


def layout(gang) -> list[list[int]]:
    """The ranks of each node that has any, the nodes in the order of their ranks (node by node)."""
    nodes = [gang.here()] + [sorted(link.ranks) for link in gang.links]
    return sorted((ranks for ranks in nodes if ranks), key=lambda ranks: ranks[0])


def place(gang, rank: int) -> dict:
    """``rank``'s place (its environment) in the gang as it is now."""
    nodes = layout(gang)
    node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    return node_place(rank, gang.world_size, nodes[node].index(rank), len(nodes[node]), node, len(nodes))


def renumber(gang, moves: dict) -> None:
    """``Gang.renumber`` (old rank -> new, in order: the pool shrank) across the nodes: each agent told first (its
    calls are applied in order: before any command for the new numbers), a node left with no rank let go (its
    agent's stream ends), its link's ranks renumbered; then the gang's ``Membership`` moves the ranks (the node
    names with them; the streams' records and the values owed follow its ``Moved``: ``ClusterGang.on_Moved``);
    then each rank's spec says its new place (a replacement forked later starts there)."""
    for link in gang.links:
        mine = {r: moves[r] for r in link.ranks if r in moves}
        if mine:
            link.control(agentmessages.Renumber(mine))
            link.unmarked.append(mine)  # (until its agent's mark: remote.Link.current)
        elif link.ranks and link.lost and not link.clean:  # (a node gone silent: its agent may still run them)
            placement.forget(link.actor, gang.ray)
        elif link.ranks:
            link.control(agentmessages.Finish())
        link.ranks = sorted(mine.values())
    Gang.renumber(gang, moves)
    placed_anew(gang)


def moved(gang, event) -> None:
    """``ClusterGang.on_Moved``: as any gang's tables (``Gang.on_Moved``); the streams' remote ranks and the remote
    ranks that had the values owed follow (each node's agent was told first: ``renumber``)."""
    Gang.on_Moved(gang, event)
    if gang.streams is not None:
        gang.streams.renumber(event.moves)
    gang.given = {event.moves[r] for r in gang.given if r in event.moves}


def placed_anew(gang) -> None:
    """Each rank's spec says its place as the gang is now."""
    for rank, spec in gang.specs.items():
        gang.specs[rank] = dataclasses.replace(spec, env={**spec.env, **place(gang, rank)})


def _chunks(gang, ranks: list) -> list[list[int]]:
    """New ranks by node: ``per_node`` on each, fewer on the last."""
    return [ranks[i:i + gang.per_node] for i in range(0, len(ranks), gang.per_node)]


def room(gang, n: int) -> list:
    """Where each node's worth of ``n`` more ranks (``_chunks``) goes, in their order, found before anything
    changes: a node the pool holds with no rank left and a bundle that holds that many (a shrink: its bundle
    still reserved, its agent there; the link), else a node it does not use, reserved (node, placement group,
    bundle; released with the pool's), else UsageError, the groups reserved so far released."""
    chunks = _chunks(gang, list(range(n)))
    spare = _emptied(gang)
    where, found, used = [], [], [node.node_id for node in gang.placed]
    for chunk in chunks:
        again = next((link for link in spare if link.slots >= len(chunk)), None)
        if again is not None:
            spare.remove(again)
            where.append(again)
            continue
        bundle = placement.bundle_for(len(chunk), gang.plan.accelerator)
        got = placement.room(gang.ray, len(gang.placed) + len(found), used, bundle, timeline.MOVE_S)
        if got is None:
            for _, pg, _ in found:
                placement.release(pg)
                gang.extra_pgs.remove(pg)
            raise UsageError(f"%ddp resize: {n} more rank(s) want {len(chunks)} more node(s) (--devices "
                             f"{gang.per_node} on each), and Ray found {len(where)} node(s) the pool "
                             f"does not use with {bundle} free within {timeline.MOVE_S:g} s. Add nodes (ray start "
                             "--address ...), or resize to fewer. Nothing changed.")
        found.append(got)
        where.append(got)
        gang.extra_pgs.append(got[1])  # (released with the pool's own, whatever stops the resize)
        used.append(got[0].node_id)
    return where


def _emptied(gang) -> list:
    """The links of nodes the pool holds with no rank left, whose agent's stream for the pool ended cleanly
    (awaited a little: a shrink just told it to finish)."""
    empty = [link for link in gang.links if not link.ranks]
    end = time.monotonic() + timeline.EMPTIED_S
    gang.sup.wait(None, until=lambda: all(link.lost for link in empty) or time.monotonic() >= end, wake_at=end)
    return [link for link in empty if link.lost and link.clean]


def grow(gang, world_size: int, found: list) -> None:
    """Ranks ``gang.world_size .. world_size - 1`` added where ``room`` found (``Membership.grow``: a fresh group),
    each node's forked by its agent (relocate.node_again, relocate.new_node) into it; every rank's spec says its
    place after."""
    nodes = len(layout(gang))
    chunks = _chunks(gang, list(range(gang.world_size, world_size)))
    # a GPU node's ranks see the GPUs Ray gave its agent as 0..n-1
    devices = [d for chunk in chunks for d in (range(len(chunk)) if gang.plan.accelerator == "cuda"
                                                   else [None] * len(chunk))]
    gang.members.grow(tuple(devices))
    for node, (chunk, where) in enumerate(zip(chunks, found), start=nodes):
        for local, rank in enumerate(chunk):
            spec = gang.specs[rank]
            env = node_place(rank, world_size, local, len(chunk), node, nodes + len(chunks))
            gang.specs[rank] = dataclasses.replace(spec, env={**spec.env, **env})
        if isinstance(where, remote.Link):
            relocate.node_again(gang, chunk, where)
        else:
            relocate.new_node(gang, chunk, where)
    placed_anew(gang)
