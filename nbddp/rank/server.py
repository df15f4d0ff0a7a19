"""The job every rank runs: it answers the kernel's commands (``RunCell``, ``Call``, ``HealthCheck``, ``Regroup``,
``Stop``), each with exactly one answer on the rank's channel (``Result``, ``Error``, ``Exit``,
``Healthy``).

A one-shot cell's ranks get their one command with the fork (or, spawned, pickled with the job),
answer it, and leave when the kernel says every rank has answered (``Stop`` on the command pipe: nbddp's
own synchronisation, which never touches the user's process group); an exception or ``sys.exit()`` ends
the rank, as a script ends, once the kernel has its report (worker._held). A pool's
ranks read commands from their command pipe until ``Stop``, and what a cell defines stays in the rank's
namespace for the next one; an exception is answered and the rank lives on. SIGUSR2 raises
KeyboardInterrupt in a running command (how the kernel relays Jupyter's interrupt to a pool, or frees
ranks after a peer failed); between commands it is ignored.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import signal
import sys
import time

import cloudpickle

from ..wire import messages, values
from . import debug, debugpanel, jobs, libstate, ncclabort, profile_session, stdin, usergroup
from .commands import CommandPipe
from .jobs import CellJob, fresh_namespace
from .stdio import flush_streams
from .worker import exit_code, exit_site, place_env, report

INJECTED = {"rank", "local_rank", "world_size", "device", "exit", "quit"}
INTERRUPT = signal.SIGUSR2


class Server:
    """``first``: a one-shot cell's command (answered, then the rank leaves). ``cmd_pipes``: a pool's
    command pipe per rank (read, write). ``namespace``: with fork, the kernel's user_ns (each rank has
    its own copy); spawned ranks start from a fresh one, and the notebook values a cell reads arrive
    with it."""

    def __init__(self, *, first=None, cmd_pipes: dict[int, tuple[int, int]] | None = None, namespace=None):
        self.first = first
        self.cmd_pipes = cmd_pipes or {}
        self.namespace = namespace

    @property
    def one_shot(self) -> bool:
        """Its ranks answer one cell and leave (a failed one waits for the kernel to stop it: worker._held)."""
        return self.first is not None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["namespace"] = None  # the kernel's namespace never travels (spawn)
        return state

    def __call__(self, ctx) -> messages.Result | None:
        """A one-shot rank's Result (sent by the worker before it leaves), or None after a pool's Stop."""
        ns = self.namespace if self.namespace is not None else fresh_namespace()
        ctx = dataclasses.replace(ctx, namespace=ns, owned=set())
        if self.namespace is not None:  # forked: what libraries cached in the kernel becomes the rank's own
            libstate.after_fork(ns, ctx)
        # what the kernel has too (by reference on the way back); spawn: cloudpickle's class tracking
        notebook = values.notebook_objects(ns) if self.namespace is not None else None
        busy = []
        imports = _Imports()

        watches = []  # on NCCL: ncclabort's, told each time this handler runs

        def interrupt(signum, frame):
            for watch in watches:
                watch.heard()
            if busy:
                if pipe is not None:  # a pool's: back in Python, its answer comes (kernel/cells/grace.py)
                    ctx.channel.try_send(messages.Heard())
                raise KeyboardInterrupt

        signal.signal(INTERRUPT, interrupt)
        pipe = CommandPipe(self._own_end(ctx.rank)) if self.cmd_pipes else None
        watch = ncclabort.install(busy, INTERRUPT) if pipe is not None and usergroup.on_nccl() else None
        if watch is not None:  # a collective no interrupt reaches: its communicators aborted
            watches.append(watch)
        stdin.install(pipe, ctx.channel)  # input() and pdb: the notebook's input box, through the kernel
        debug.install()
        if self.first is not None:
            busy.append(object())  # an exception or exit() ends the rank, as a script does; what the cell
            result = imports.said(_run(self.first, ns, ctx, notebook, track=False))  # assigned dies with the rank
            busy.clear()
            if pipe is None:
                return result  # spawned: the worker sends it, then leaves by a barrier on nbddp's store
            flush_streams()
            ctx.channel.send(result)  # before waiting: a peer that left early cannot cost it its values
            pipe.until(lambda cmd: isinstance(cmd, messages.Stop))
            return None
        bound = _Bindings(ns)
        while True:
            for cmd in pipe.next():
                if isinstance(cmd, messages.Stop):
                    return None
                if isinstance(cmd, messages.InputReply):
                    continue  # the answer to a prompt its cell no longer waits for (the cell was interrupted)
                usergroup.release_destroyed()  # idle since the last command: safe to free (usergroup)
                if watch is not None:
                    watch.rearm()
                if isinstance(cmd, messages.Regroup) and cmd.rank is not None:
                    ctx = renumbered(ctx, cmd.rank, cmd.world_size, cmd.place)
                busy.append(object())  # this command's token (ncclabort)
                try:
                    answer = imports.said(_answer(cmd, ns, ctx, notebook, bound))
                finally:
                    busy.clear()
                if answer is not None:
                    flush_streams()
                    ctx.channel.send(answer)
                bound.snapshot()  # idle again: off the next cell's path

    def _own_end(self, rank: int) -> int:
        """This rank's read end; the others' ends closed (a forkserver's rank is given its own end only)."""
        for r, (read, write) in self.cmd_pipes.items():
            if write is not None:
                os.close(write)
            if r != rank:
                os.close(read)
        return self.cmd_pipes[rank][0]


def _answer(cmd, ns: dict, ctx, notebook, bound=None):
    """A pool's command: its answer; an exception is reported on the channel and the rank lives on."""
    try:
        if isinstance(cmd, messages.HealthCheck):
            import torch.distributed as dist

            dist.barrier()
            return messages.Healthy()
        if isinstance(cmd, messages.Update):
            _receive(cmd, ns, ctx, notebook)
            return None
        if isinstance(cmd, messages.PostMortem):
            debug.post_mortem_last(ctx.rank)
            return messages.Result()
        if isinstance(cmd, messages.Regroup):
            try:
                old = usergroup.regroup(cmd.generation, cmd.rank, cmd.world_size)
            except BaseException as e:  # noqa: BLE001 - said as the group's failure (an interrupt too: as "cell" the
                report(ctx.channel, "group", e)  # kernel, awaiting the group's answer, would take it for none)
                return None
            return messages.Healthy(bound=_bound_to(old, ns))
        return _run(cmd, ns, ctx, notebook, bound=bound)
    except SystemExit as e:
        return messages.Exit(exit_code(e), exit_site(e), "cell", time.time())
    except BaseException as e:  # noqa: BLE001 - the rank lives on; the kernel decides
        report(ctx.channel, "cell", e)
        return None


def renumbered(ctx, rank: int, world_size: int, place: dict | None = None):
    """The rank's context at its new place (a pool shrunk or resized): its names, its environment and the
    launchers' view of it say the new rank and world size from now on; ``place``, where given, the environment
    that says it (a pool across nodes: LOCAL_RANK is the rank's place on its node)."""
    from . import launchers

    place = place or place_env(rank, world_size)
    os.environ.update(place)
    launchers.renumber(rank, world_size)
    local_rank = int(place.get("LOCAL_RANK", rank))
    ctx = dataclasses.replace(ctx, rank=rank, local_rank=local_rank, world_size=world_size)
    ctx.namespace.update(rank=rank, local_rank=local_rank, world_size=world_size)
    return ctx


def _bound_to(group, ns: dict) -> tuple:
    """Names in the rank's namespace bound to ``group`` (a process group just left): DDP models, the
    group itself, groups made from it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    found = []
    for name, value in ns.items():
        if name.startswith("_"):
            continue
        if isinstance(value, DistributedDataParallel) and getattr(value, "process_group", None) is group:
            found.append(f"{name} (DistributedDataParallel: {name} = DDP({name}.module))")
        elif isinstance(value, dist.ProcessGroup):  # destroyed with the default group
            found.append(f"{name} (a process group: make it again with dist.new_group)")
    return tuple(found)


def _run(cmd, ns: dict, ctx, notebook, track: bool = True, bound=None) -> messages.Result:
    if isinstance(cmd, messages.Call):  # a one-shot call's job came with the fork: not pickled
        job = cmd.job if callable(cmd.job) else cloudpickle.loads(cmd.job)
        return job(ctx)
    return _run_cell(cmd, ns, ctx, notebook, track, bound)


def _receive(cmd, ns: dict, ctx, notebook) -> None:
    """The notebook names a command carries (``RunCell``, ``Update``), into the rank's namespace; the
    names it drops (their notebook value cannot be sent: the rank's copy is stale), out of it. Either way
    they are the notebook's now, not the pool's own (``ctx.owned``)."""
    if ctx.owned is not None:
        ctx.owned.difference_update(cmd.dropped, cmd.updates)
    for name in cmd.dropped:
        ns.pop(name, None)
    for name, blob in cmd.updates.items():
        ns[name] = jobs.in_namespace(cloudpickle.loads(blob), ns)
        if notebook is not None:  # the notebook has this very value under this name
            notebook[id(ns[name])] = (name, ns[name])
    libstate.before_cell(ns, cmd, ctx)  # what libraries cached in the kernel becomes the rank's own


def _run_cell(cmd: messages.RunCell, ns: dict, ctx, notebook, track: bool, bound=None) -> messages.Result:
    """``track``: say which names the cell (re)bound (a pool keeps them the rank's own); ``bound``: the
    namespace as the rank left it after its last command."""
    _receive(cmd, ns, ctx, notebook)
    debug.new_cell()
    debugpanel.before_cell(cmd.debug)
    profiler, summary = None, None
    try:
        profiler = profile_session.begin(cmd.profile, ctx.rank, getattr(ctx.device, "type", "cpu"))  # --profile only
        result = _run_job(cmd, ns, ctx, notebook, track, bound)
    finally:
        if profiler is not None:
            summary = profiler.end()  # (the hook removed and the profiler stopped however the cell ended)
        debugpanel.after_cell()
    return result if summary is None else dataclasses.replace(result, profile=summary)


def _run_job(cmd: messages.RunCell, ns: dict, ctx, notebook, track: bool, bound) -> messages.Result:
    job = CellJob(cmd.source, cmd.filename, outs=cmd.outs, gathers=cmd.gathers, max_value_bytes=cmd.max_value_bytes,
                  post_mortem=cmd.post_mortem, lead=cmd.lead)
    if not track:
        return job.run_in(ns, ctx, notebook)
    bound = bound or _Bindings(ns)
    bound.before_cell(cmd.updates)
    try:
        result = job.run_in(ns, ctx, notebook)
    finally:
        assigned = tuple(k for k in bound.since() if k not in INJECTED)
        if ctx.owned is not None:  # (a failed cell's too: what it bound before failing is the rank's own)
            ctx.owned.update(k for k in assigned if not k.startswith("_"))
        if notebook is not None:  # the rank's own now: they travel by value
            for name in assigned:
                notebook.pop(id(ns[name]), None)
    return dataclasses.replace(result, assigned=assigned)


class _Imports:
    """Modules the rank imported since its last answer, said with its next ``Result``: the kernel imports
    them too (kernel/ranks/warm.py), so the next fork starts with them."""

    def __init__(self):
        self.seen = len(sys.modules)

    def said(self, answer):
        n = len(sys.modules)
        if n <= self.seen or not isinstance(answer, messages.Result):
            return answer
        new = tuple(itertools.islice(sys.modules, self.seen, None))
        self.seen = n
        return dataclasses.replace(answer, imported=new)


class _Bindings:
    """Which names a pool's cell (re)bound: the namespace's names and the ids of their values as the rank's
    last command left them (taken while it was idle), compared with the namespace after the cell. Lists,
    not dicts: the cell's path builds no table of the notebook's hundreds of names (3x cheaper, measured)."""

    def __init__(self, ns: dict):
        self.ns = ns
        self.keys: list | None = None
        self.ids: list = []

    def snapshot(self) -> None:
        self.keys, self.ids = list(self.ns), list(map(id, self.ns.values()))

    def before_cell(self, received) -> None:
        """The notebook values the cell's command brought (``received``) are not the cell's own bindings."""
        if self.keys is None or received:
            self.snapshot()

    def since(self) -> list:
        """The names (re)bound since the snapshot, sorted."""
        keys, ids = self.keys, self.ids
        now_keys, now_ids = list(self.ns), list(map(id, self.ns.values()))
        n = len(keys)
        if now_keys[:n] == keys:  # no name deleted: the old names where they were, new ones after them
            names = [keys[i] for i in itertools.compress(range(n), map(operator.ne, now_ids, ids))] + now_keys[n:]
        else:
            old = dict(zip(keys, ids))
            names = [k for k, i in zip(now_keys, now_ids) if old.get(k) != i]
        return sorted(names)
