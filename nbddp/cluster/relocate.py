"""In the kernel: ranks of a pool across Ray nodes started by a new agent on a node of their own.

- ``lost_node``: the ranks of a node whose agent was lost (healing). The lost agent is ended (hung or cut off,
  its ranks end with it). Its node, if Ray still has it, else the node Ray moved its bundle of the pool's
  placement group to, else a node with the room the pool does not use (``placement.moved``), gets a new agent,
  which forks those ranks into the process group's next generation, as the pool's start did.
- ``new_node``: ranks added to the pool (``%ddp resize`` to more), on a node with the room the pool did not
  use (reserved by ``reshape.room``), its agent's link appended to the gang's; ``node_again``: on a node the
  pool holds but left with no rank (a shrink), by the agent it had there.

Either way the new agent's stream joins the others (``remote.Streams.follow``).
"""
from __future__ import annotations

import dataclasses
import pickle

from .. import timeline
from ..kernel.ranks import starters
from ..kernel.ranks.gang import ReplaceFailed
from . import placement, remote


def lost_node(gang, old) -> None:
    """The ranks of the node whose agent was lost (``old``: its link), started anew by a new agent (on that node,
    or another: ``placement.moved``), joining the group's generation now; ReplaceFailed if Ray has no node with
    the room within MOVE_S."""
    index = gang.links.index(old) + 1  # (node 0 is the kernel's)
    placement.forget(old.actor, gang.ray)  # (a hung agent, or one whose stream broke: its ranks end with it)
    found = placement.moved(gang.ray, gang.pg, gang.placed[index], [n.node_id for n in gang.placed],
                            placement.bundle_for(gang.per_node, gang.plan.accelerator), timeline.MOVE_S)
    if found is None:
        raise ReplaceFailed(f"node {old.node} is lost ({old.lost}), and Ray found no other node with the room "
                            f"for its rank(s) within {timeline.MOVE_S:g} s", started=False)
    if found[1] is not gang.pg:
        gang.extra_pgs.append(found[1])  # (released with the pool's own)
    gang.forget_ended(old.ranks)
    actor = _agent(gang, found, len(old.ranks))
    gang.links[index - 1] = _started(gang, found[0], actor, old.ranks, f"node {old.node} is lost, and ")


def new_node(gang, ranks: list, found) -> None:
    """``ranks`` (new numbers, their specs made) started by a new agent on the node ``found`` (node, placement group,
    bundle: reshape.room's), a node the pool did not use, joining the group's generation now."""
    gang.placed.append(found[0])
    gang.links.append(_started(gang, found[0], _agent(gang, found, len(ranks)), ranks, ""))


def node_again(gang, ranks: list, old) -> None:
    """``ranks`` started on a node the pool holds but left with no rank (``old``: its link, whose stream ended
    cleanly: a shrink), by the agent it had there, whose bundle the pool still holds."""
    index = gang.links.index(old) + 1
    gang.links[index - 1] = link = _started(gang, gang.placed[index], old.actor, ranks, "")
    link.slots = old.slots  # (its bundle is the one it had)


def _agent(gang, found, n: int):
    """A new agent for ``n`` ranks where ``found`` (node, placement group, bundle) says (a GPU pool's sits in the
    bundle, holding their GPUs)."""
    to, pg, bundle = found
    in_bundle = dataclasses.replace(to, index=bundle)
    actor = placement.agents(gang.ray, pg, [gang.placed[0], in_bundle], n, gang.plan.accelerator)[0]
    gang.actors.append(actor)
    return actor


def _started(gang, to, actor, ranks: list, why: str) -> remote.Link:
    """``ranks`` forked on node ``to`` (its pool's node index) by ``actor``, its agent, joining the group's
    generation now; their link, its stream followed."""
    index = to.index
    specs = [starters.again(gang.specs[r], gang.generation) for r in ranks]
    try:
        where = gang.ray.get(actor.where.remote(), timeout=placement.START_S)
        gen = actor.events.options(num_returns="streaming").remote(gang.run_dir.run_id, specs, gang.user_if)
        if not gang.ray.wait([gen], timeout=placement.START_S)[0]:
            raise TimeoutError(f"no answer within {placement.START_S:g} s")
        pids = pickle.loads(gang.ray.get(next(gen)))
    except Exception as e:  # noqa: BLE001 - Ray's errors are many: said
        raise ReplaceFailed(f"{why}the agent on node {to.label} did not start its rank(s): {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
    to.host = where["host"]
    if not (gang.user_if or where["ifname"]):
        raise ReplaceFailed(placement.no_interface(to.ip, f"node {to.label}"))
    gang.placed[index] = to
    link = remote.Link(actor, to.label, list(ranks), gang.run_dir.run_id)
    gang.members.place(ranks, to.label)
    for r in ranks:
        gang.streams.add(r, pids[r], link)
        if gang.view is not None and getattr(gang.view, "nodes", None):
            gang.view.nodes[r] = f"node {index} ({to.host or to.ip})"
    gang.streams.follow(link, gen)
    return link
