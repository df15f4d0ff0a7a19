"""In a rank: the user's own ``init_process_group``/``destroy_process_group`` calls, as under torchrun.

A script written for torchrun creates the default process group itself and often destroys it at the
end. In a ``%%ddp`` cell nbddp has already made that group, so the script's
``init_process_group()`` would fail with "trying to initialize the default process group twice!".

``install()`` (called right after nbddp's own ``init_process_group``) makes the user's call *join*
nbddp's group when it asks for the same group (any ``init_method``, ``backend`` None or the one in use,
``rank``/``world_size`` -1 or this rank's). A second call by the user fails exactly as under torchrun.
``destroy_process_group()`` really destroys the group: what follows sees none, as under torchrun, and
nbddp's teardown then leaves it alone (``group_alive()``). A later ``init_process_group`` builds a
fresh group on nbddp's store (a new key prefix per generation, so old keys never collide).

A destroyed group's object is kept (``kept``) until the rank is idle (``release_destroyed``, before a
pool's next command; a one-shot rank exits without freeing it). Freed at once, it can deadlock: torch's
``ProcessGroupGloo`` destructor joins its worker threads with the GIL held, and a worker may still be
dropping its last finished work, whose captured thread-local state holds a Python object (the
``contextvars.Context`` that autograd stashes during ``backward``, captured when DDP's reducer launches
an all_reduce from a gradient hook), and waits for that GIL. A torchrun script that lets its DDP model
go after ``destroy_process_group()`` (``main()`` returning) then never ends.
"""
from __future__ import annotations

import functools
import os

_state: dict = {}


def install(group_sockets=frozenset(), store=None, generation: int = 0) -> None:
    """Call once in a rank, right after nbddp's own ``init_process_group``; ``group_sockets``: the sockets
    that init opened (its connections to the peers: ``sockets()``'s (descriptor, inode) pairs); ``store``:
    nbddp's store the group met on (without a generation's prefix: later generations meet under their own);
    ``generation``: the group's."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _state:
        return
    _state.update(
        store=store if store is not None else c10d._get_default_store(),  # also kept alive after a destroy
        backend=str(dist.get_backend()),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        generation=0,
        joined=False,
        original=c10d.init_process_group,
        original_destroy=c10d.destroy_process_group,
        kept=[],
        sockets=set(group_sockets),
    )
    patched = functools.wraps(c10d.init_process_group)(_init_process_group)
    dist.init_process_group = c10d.init_process_group = patched
    destroy = functools.wraps(c10d.destroy_process_group)(_destroy_process_group)
    dist.destroy_process_group = c10d.destroy_process_group = destroy


def keep(obj) -> None:
    """Keep ``obj`` (a DDP model of a group that is gone) until the rank is idle, as destroyed groups are."""
    _state.setdefault("kept", []).append(obj)


def release_destroyed() -> None:
    """Let the groups destroyed so far go (the rank is idle: no worker of theirs is finishing work)."""
    _state.get("kept", []).clear()


def generation_store(store, generation: int):
    """Where generation ``generation`` of nbddp's group meets on ``store`` (0: the store itself)."""
    if not generation:
        return store
    from torch.distributed import PrefixStore

    return PrefixStore(f"nbddp-regroup-{generation}", store)


def regroup(generation: int, rank: int | None = None, world_size: int | None = None):
    """nbddp's own fresh group (a pool after a collective no peer would join, or one that lost a rank whose
    replacement joins it): the old one destroyed here, then made again on nbddp's store under the
    generation's prefix, with the same ranks. Returns the old group (what the rank's objects bound to it
    point at). ``rank``, ``world_size``: the rank's place in the new group, where the pool was renumbered
    (shrunk or resized)."""
    import torch.distributed as dist

    s = _state
    if rank is not None:
        s["rank"], s["world_size"] = rank, world_size
    from torch.distributed import distributed_c10d as c10d

    aborted = s.pop("aborted", None)
    old = c10d._get_default_group() if dist.is_initialized() else aborted
    if aborted is None:  # (after an abort those descriptor numbers may be another's by now)
        _shut(s["sockets"])  # the peers see this rank leave even if a process it forked holds these descriptors
    if dist.is_initialized():
        try:
            if on_nccl():  # its communicators may wait on a peer that is gone: destroy would too
                s["kept"].extend(list(c10d._world.pg_map))  # (freed once idle, as destroyed ones are)
                c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group already broken by a peer's leaving: what is left of it goes with it
            pass
    before = sockets()
    s["original"](backend=s["backend"], store=generation_store(s["store"], generation),
                  rank=s["rank"], world_size=s["world_size"])
    s["sockets"] = sockets() - before
    return old


def on_nccl() -> bool:
    """Whether nbddp's group is on NCCL (its communicators are aborted, never destroyed, when it is left)."""
    return "nccl" in _state.get("backend", "")


def aborted(group, groups=()) -> None:
    """``group`` (the default one) is aborted by ``ncclabort``, with ``groups`` (every group of the rank):
    ``regroup`` still says what was bound to it, and their objects are kept until the rank is idle."""
    _state["aborted"] = group
    _state.setdefault("kept", []).extend(groups)


def sockets() -> set[tuple[int, str]]:
    """This process's sockets, each (descriptor, its inode) (Linux; elsewhere none are known). Not the number
    alone: a group's descriptors closed by gloo's loop thread while the next group connects (a peer gone, this
    rank's own shutdown) are reused at once by the new group's connections, which a set of numbers taken
    before would then leave out of ``sockets() - before``."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    found = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add((int(fd), link))
    return found


def _shut(fds) -> None:
    """``fds`` (``sockets()``'s pairs) shut down; a descriptor that holds another socket by now is left alone."""
    import socket

    for fd, link in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed since, its number another socket's
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # a listener (gloo's) stays
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()


def group_alive() -> bool:
    """Whether a default process group exists (nbddp's, or one the user re-made after destroying it)."""
    import torch.distributed as dist

    return dist.is_initialized()


def _init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                        group_name="", pg_options=None, device_id=None, **kwargs):
    import torch.distributed as dist

    s = _state
    _check_same_group(backend, world_size, rank)
    if dist.is_initialized():
        if s["joined"]:  # the user's own second call: fail as torchrun would
            return s["original"](backend, init_method, timeout, world_size, rank, store, group_name,
                                 pg_options, device_id, **kwargs)
        s["joined"] = True
        if timeout is not None:
            _set_timeout(timeout)
        return None
    # the user destroyed the group and makes a new one: same ranks, nbddp's store, a fresh key prefix
    from torch.distributed import PrefixStore

    s["generation"] += 1
    s["joined"] = True
    if store is None:
        store = PrefixStore(f"nbddp-user-group-{s['generation']}", s["store"])
    args = dict(backend=backend or s["backend"], store=store, rank=s["rank"], world_size=s["world_size"],
                pg_options=pg_options, device_id=device_id, **kwargs)
    if timeout is not None:
        args["timeout"] = timeout
    return s["original"](**args)


def _destroy_process_group(group=None):
    """torch's ``destroy_process_group``, the destroyed groups kept until the rank is idle (see above)."""
    from torch.distributed import distributed_c10d as c10d

    s = _state
    if group is None or group is c10d.GroupMember.WORLD:
        s["kept"].extend(getattr(getattr(c10d, "_world", None), "pg_map", None) or
                         ([c10d._get_default_group()] if c10d.is_initialized() else []))
    else:
        s["kept"].append(group)
    return s["original_destroy"](group)


def _check_same_group(backend, world_size, rank) -> None:
    s = _state
    problems = []
    if backend not in (None, "undefined") and s["backend"] not in _backends(str(backend)):
        problems.append(f"backend={backend!r}, but this cell's ranks use {s['backend']!r}")
    if world_size not in (-1, None) and int(world_size) != s["world_size"]:
        problems.append(f"world_size={world_size}, but the cell runs {s['world_size']} ranks")
    if rank not in (-1, None) and int(rank) != s["rank"]:
        problems.append(f"rank={rank}, but this is rank {s['rank']}")
    if problems:
        flag = f"--backend {backend}" if "backend" in problems[0] else f"--devices {world_size}"
        raise ValueError(
            f"rank {s['rank']}: init_process_group({'; '.join(problems)}).\n"
            "In a %%ddp cell nbddp has already created the process group, and the cell's own "
            "init_process_group joins it; it cannot make a different one.\n"
            f"Fix: start the cell with `%%ddp {flag}`, or pass rank/world_size from the environment "
            "(int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])), as under torchrun."
        )


def _backends(spec: str) -> set[str]:
    """"gloo" → {"gloo"}; "cpu:gloo,cuda:nccl" → {"gloo", "nccl"}."""
    return {part.split(":")[-1].strip().lower() for part in spec.split(",")}


def _set_timeout(timeout) -> None:
    try:
        from torch.distributed import distributed_c10d as c10d

        c10d._set_pg_timeout(timeout)
    except Exception:  # noqa: BLE001 - an older torch, or a backend without per-group timeouts: keep nbddp's
        pass
