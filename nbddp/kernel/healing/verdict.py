"""Which names a new rank may be given, from the survivors' fingerprints (rank/heal.py's ``survey``): pure, no rank
and no process touched. A name the pool's cells bound is copied where two survivors or more hold it alike; a notebook
name where a pool's cell changed it in place alike on every survivor; anything else is lacking, with why, and so is a
name that shares tensors with a lacking one (an optimizer whose model lacks)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Verdict:
    agreed: list  # names every survivor holds alike (two or more of them)
    remade: list  # of those, what is bound to the group: DDP models, DeviceMeshes, replicated DTensors (made anew)
    lacking: dict  # name -> why the replacement lacks it
    stale: list  # such names on the survivors that no replacement has (bound to the old group until run again)


def verdict(views: dict, fresh: dict | None = None) -> Verdict:
    """What may be copied, from each survivor's survey (rank -> name -> (kind, fingerprint or why, tensors,
    bound by the pool's cells)) and ``fresh``, a new rank's own survey of the notebook's names (a fork of the
    kernel now: what it has without a copy), or None (it has none of them: a forkserver's)."""
    names = sorted(set().union(*views.values())) if views else []
    agreed, remade, lacking, stale = [], [], {}, []
    for name in names:
        seen = [v[name] for v in views.values() if name in v]
        kinds, prints = {x[0] for x in seen}, {x[1] for x in seen}
        why = _notebook_name(name, seen, prints, views, fresh) if not any(x[3] for x in seen) else \
            _pool_name(seen, kinds, prints, views)
        if why == "agreed":
            agreed.append(name)
            if "remade" in kinds:
                remade.append(name)
        elif why:
            lacking[name] = why
    _lacking_with_what_they_share(views, agreed, lacking)
    remade = [n for n in remade if n in agreed]
    stale = [n for n in lacking if any(v.get(n, ("",))[0] in ("remade", "bound") for v in views.values())]
    return Verdict(agreed, remade, lacking, stale)


def _pool_name(seen, kinds, prints, views) -> str:
    """A name the pool's cells bound: copied where two survivors or more agree, else why not."""
    lost = next((x[1] for x in seen if x[0] in ("lost", "bound")), None)
    if lost is not None:
        return lost
    if len(views) < 2:
        return "only one survivor holds it: no second rank can vouch that it is not rank-specific"
    if len(seen) < len(views):
        return "not every survivor holds it"
    if len(prints) > 1:
        return "its value differs between ranks (made from rank)"
    return "agreed"


def _notebook_name(name, seen, prints, views, fresh) -> str:
    """A notebook name the survivors hold: nothing to do where the new rank has it alike; copied where a pool's
    cell changed it in place alike on every survivor; lacking where they changed it differently."""
    if fresh is None or any(x[0] in ("lost", "bound") for x in seen) or len(seen) < len(views):
        return ""
    mine = fresh.get(name)
    if len(prints) == 1 and mine is not None and mine[1] in prints:
        return ""
    if len(prints) > 1:
        return "a pool's cell changed this notebook value in place, differently on each rank"
    if len(views) < 2:
        return ("a pool's cell changed this notebook value in place; only one survivor holds it: no second rank can "
                "vouch that it is not rank-specific")
    return "agreed"


def _lacking_with_what_they_share(views, agreed: list, lacking: dict) -> None:
    """A name that holds tensors a lacking name holds (an optimizer whose model lacks) lacks too: copied alone,
    it would point at parameters the new rank's model does not have."""
    view = next(iter(views.values()), {})
    changed = True
    while changed:
        changed = False
        held = {n: set(view[n][2]) for n in lacking if n in view}
        for name in list(agreed):
            shared = next((other for other, tensors in held.items() if tensors & set(view.get(name, ((),) * 3)[2])),
                          None)
            if shared is not None:
                agreed.remove(name)
                lacking[name] = f"it shares tensors with {shared}, which the new rank lacks"
                changed = True
