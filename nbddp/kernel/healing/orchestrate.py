"""Mending a pool's ranks, step by step (each step a ``Call`` on some ranks: steps.py), the pool held meanwhile.

- ``mend`` heals (a replacement with the lost rank's number and device, forked as the rank was, joins the survivors
  in a new process group at the same world size, and takes the pool's state from a survivor: rank/heal.py) or
  shrinks (the survivors renumbered in order, a new group at N-1); either way every DistributedDataParallel in a
  rank's namespace is made anew on the new group. A replacement that cannot start, none having started (no memory,
  no node with the room), shrinks the pool instead, saying why. Whatever else fails while mending (a second rank
  lost, a step that does not answer within its time, an interrupt) is ``HealFailed`` (or the interrupt): the pool's
  side (mending.py) ends the pool with that reason, so nothing hangs and nothing is left running.
- ``resize``: ``%ddp resize N``, grown or shrunk, the state kept.
- ``regrouped``: after the stuck-collective path's fresh process group (cells/recovery.py), the DDP models made anew.
"""
from __future__ import annotations

import time

from ... import timeline
from ...rank import heal
from ...wire import messages
from ..ranks.gang import ReplaceFailed
from .report import Mended
from .steps import HealFailed, ask, call, value
from .verdict import Verdict, verdict


def mend(pool, policy) -> Mended:
    """The pool's pending losses mended as ``policy`` (options.OnLoss: heal, a replacement for each, or shrink) says;
    HealFailed if it cannot be."""
    gang = pool.gang
    start = time.monotonic()
    settled = start + timeline.SETTLE_S  # losses that come together (the OOM killer's) are mended together
    gang.sup.wait(None, until=lambda: time.monotonic() >= settled, wake_at=settled)
    losses = list(pool.losses.pending)
    survivors = sorted(p.rank for p in gang.sup.live())
    if not survivors:
        raise HealFailed("no rank survived")
    if pool.config.cluster and "nccl" in gang.plan.backend:  # (give/take send CPU tensors over the group)
        raise HealFailed("a pool across Ray nodes on NCCL cannot be mended yet: %ddp restart and re-run the cells "
                         "that build the state")
    if policy.replaces:
        mended = _heal(gang, survivors, losses, pool.starter.inherits_notebook)
    else:
        mended = _shrink(gang, survivors, losses)
    mended.seconds = time.monotonic() - start
    pool.losses.mended()
    return mended


def _heal(gang, survivors: list, losses: list, inherited: bool) -> Mended:
    """The group first: a survivor still waiting in a collective with the lost rank (or with a peer that left
    it) is freed as the others leave the old group, answers its cell, then joins; then the state."""
    lost = sorted({loss.rank for loss in losses})
    generation = gang.next_generation()  # one fresh group: the survivors and every replacement join it
    started = []
    for rank in lost:
        try:
            gang.replace(rank)
        except ReplaceFailed as e:
            if e.started:
                raise
            return _shrunk_instead(gang, survivors, losses, started, f"no new rank {rank} could start ({e})")
        started.append(rank)
    _join(gang, {r: messages.Regroup(generation) for r in survivors}, lost)
    found = _hand_over(gang, survivors, lost, inherited)
    rebuilt, unmade = _rebuild(gang, found.remade)
    return Mended("healed", losses, 0.0, copied=found.agreed, peer=survivors[0], lacking=found.lacking, unmade=unmade,
                  rebuilt=rebuilt)


def _shrunk_instead(gang, survivors: list, losses: list, started: list, why: str) -> Mended:
    """A replacement could not start, before it forked (no memory, no node with the room): the survivors, whole,
    go on, renumbered, rather than end (the replacements already started, waiting for them, killed)."""
    gang.retire(started, kill=True)
    mended = _shrink(gang, survivors, losses)
    mended.instead = why
    return mended


def _hand_over(gang, holders: list, new: list, inherited: bool) -> Verdict:
    """The names ``holders`` agree on, given to the ``new`` ranks by ``holders[0]``: through shared memory on one
    machine; over the process group where the peer and the new ranks may be on different machines (never
    through the kernel's). ``inherited``: the new ranks were forked from the kernel as it is now."""
    if gang.spans_machines:
        found = _survey(gang, holders)
        _over_the_group(gang, holders[0], new, found)
    else:
        found = _survey(gang, holders, new[0] if inherited else None)
        _adopt(gang, new, _export(gang, holders[0], found), found)
    return found


def _survey(gang, holders: list, fresh: int | None = None) -> Verdict:
    """``holders``' fingerprints, and ``fresh``'s (a new rank forked from the kernel: its notebook names as the
    kernel has them now), into a verdict; without ``fresh``, the pool's own names only."""
    commands = {r: call(heal.survey, fresh is not None) for r in holders}
    if fresh is not None:
        commands[fresh] = call(heal.survey, True)
    views = {r: value(rec) for r, rec in ask(gang, commands, "fingerprinting the pool's names").items()}
    mine = views.pop(fresh) if fresh is not None else None
    return verdict(views, mine)


def _export(gang, peer: int, found: Verdict):
    if not found.agreed:
        return None
    return value(ask(gang, {peer: call(heal.export, found.agreed)}, f"rank {peer} sent the pool's names")[peer])


def _over_the_group(gang, peer: int, new: list, found: Verdict) -> None:
    """A pool across machines: the agreed names sent by ``peer`` to the ``new`` ranks over the process group,
    point to point (heal.give, heal.take), never through this machine."""
    commands = {peer: call(heal.give, found.agreed, new)}
    commands.update({r: call(heal.take, peer, sorted(found.lacking)) for r in new})
    ask(gang, commands, f"rank {peer} sent the pool's names over the process group")


def _join(gang, regroups: dict, new: list) -> None:
    """Every rank in the group's new generation: the ranks of ``regroups`` (their late answer to a cell they
    were freed from is not the answer awaited) and the new ones (``Ready``)."""
    ask(gang, regroups, "every rank joined the new process group", within=timeline.JOIN_S,
        also=lambda: all(r in gang.ready for r in new), expect=(messages.Healthy,))


def _adopt(gang, new: list, blob, found: Verdict) -> None:
    if blob is not None or found.lacking:
        ask(gang, {r: call(heal.adopt, blob, sorted(found.lacking)) for r in new}, "the new rank took the names")


def _rebuild(gang, names: list) -> tuple[list, dict]:
    """What is bound to the group under ``names`` (DDP models, DeviceMeshes, replicated DTensors) made anew on
    every rank (collectives, in one order everywhere): (name, kind) each, and name -> why for what could not be
    (a 2-D mesh on a group of another size: run its cell again); with no names, the peer's export is let go
    all the same."""
    answers = ask(gang, {r: call(heal.rebuild, names) for r in range(gang.world_size)},
                  "DDP models and meshes were made anew")
    got = [tuple(x) for x in value(answers[0]) or []]
    return [x for x in got if len(x) == 2], {x[0]: x[2] for x in got if len(x) == 3}


def _shrink(gang, survivors: list, losses: list) -> Mended:
    moves = {old: new for new, old in enumerate(survivors)}
    gang.renumber(moves)  # (in a fresh group)
    _join(gang, {new: gang.regroup_at(new) for new in moves.values()}, [])
    found = _survey(gang, list(moves.values()))
    rebuilt, unmade = _rebuild(gang, [n for n in found.agreed if n in found.remade])
    return Mended("shrunk", losses, 0.0, lacking=_renumbered_lacking(found), unmade=unmade, rebuilt=rebuilt,
                  renumbered=moves)


def _renumbered_lacking(found: Verdict) -> dict:
    """Of a renumbered pool's names (shrunk, resized down), what was made from the old rank, and what still uses
    the old group (a shard)."""
    return {n: why for n, why in found.lacking.items() if "differs" in why or n in found.stale}


def resize(pool, world_size: int, room: tuple = ()) -> Mended:
    """``%ddp resize N``: the pool grown into ``room`` (what ``Gang.room`` found for the new ranks: their devices,
    or a pool across Ray nodes' new nodes; they take the pool's state from rank 0, as a replacement does) or
    shrunk (its highest ranks leave), in a new process group at ``world_size``, DDP models made anew."""
    gang = pool.gang
    old = gang.world_size
    start = time.monotonic()
    ranks = list(range(min(old, world_size)))
    if world_size < old:
        found = _survey(gang, list(range(old)))
        gang.retire(list(range(world_size, old)))
        gang.renumber({r: r for r in range(world_size)})  # (in a fresh group)
        _join(gang, {r: gang.regroup_at(r) for r in ranks}, [])
        mended = Mended("resized", [], 0.0, lacking=_renumbered_lacking(found))
    else:
        new = list(range(old, world_size))
        gang.grow(world_size, room)  # (in a fresh group)
        _join(gang, {r: gang.regroup_at(r) for r in ranks}, new)
        found = _hand_over(gang, ranks, new, pool.starter.inherits_notebook)
        # what uses the old group (a mesh that does not fit the new size, a group of dist.new_group) is stale on
        # the old ranks as well, not lacking on the new ones alone
        mended = Mended("resized", [], 0.0, copied=found.agreed, peer=0,
                        lacking={n: why for n, why in found.lacking.items() if n not in found.stale},
                        unmade={n: found.lacking[n] for n in found.stale})
    mended.rebuilt, unmade = _rebuild(gang, found.remade)
    mended.unmade.update(unmade)
    mended.renumbered = {r: r for r in range(world_size)}
    mended.seconds = time.monotonic() - start
    mended.sizes = (old, world_size)
    return mended


def regrouped(gang) -> list:
    """After a pool's process group was made anew (a stuck collective freed: recovery.py): the DDP models (the
    meshes, the replicated DTensors) every rank holds, made anew on it. Returns (name, kind) each."""
    stale = [set(value(rec) or ()) for rec in ask(gang, {r: call(heal.remade_names) for r in range(gang.world_size)},
                                                    "listing the DDP models and meshes").values()]
    return _rebuild(gang, sorted(set.intersection(*stale)))[0] if stale else []
