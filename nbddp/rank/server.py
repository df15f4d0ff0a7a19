"""The job every rank runs: it answers the kernel's commands (``RunCell``, ``Call``, ``HealthCheck``, ``Regroup``,
``Stop``), each with exactly one answer on the rank's channel (``Result``, ``Error``, ``Exit``,
``Healthy``).

A one-shot cell's ranks get their one command with the fork (or, spawned, pickled with the job),
answer it, and leave when the kernel says every rank has answered (``Stop`` on the command pipe: nbddp's
own synchronisation, which never touches the user's process group); an exception or ``sys.exit()`` ends
the rank at once, as a script ends. A pool's
ranks read commands from their command pipe until ``Stop``, and what a cell defines stays in the rank's
namespace for the next one; an exception is answered and the rank lives on. SIGUSR2 raises
KeyboardInterrupt in a running command (how the kernel relays Jupyter's interrupt to a pool, or frees
ranks after a peer failed); between commands it is ignored.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import cloudpickle

from ..wire import messages, values
from . import debug, jobs, libstate, stdin, usergroup
from .commands import CommandPipe
from .jobs import CellJob, fresh_namespace
from .stdio import flush_streams
from .worker import exit_code, exit_site, report

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

    def __getstate__(self):
        state = dict(self.__dict__)
        state["namespace"] = None  # the kernel's namespace never travels (spawn)
        return state

    def __call__(self, ctx) -> messages.Result | None:
        """A one-shot rank's Result (sent by the worker before it leaves), or None after a pool's Stop."""
        ns = self.namespace if self.namespace is not None else fresh_namespace()
        ctx = dataclasses.replace(ctx, namespace=ns)
        if self.namespace is not None:  # forked: what libraries cached in the kernel becomes the rank's own
            libstate.after_fork(ns, ctx)
        # what the kernel has too (by reference on the way back); spawn: cloudpickle's class tracking
        notebook = values.notebook_objects(ns) if self.namespace is not None else None
        busy = []

        def interrupt(signum, frame):
            if busy:
                raise KeyboardInterrupt

        signal.signal(INTERRUPT, interrupt)
        pipe = CommandPipe(self._own_end(ctx.rank)) if self.cmd_pipes else None
        stdin.install(pipe, ctx.channel)  # input() and pdb: the notebook's input box, through the kernel
        debug.install()
        if self.first is not None:
            busy.append(True)  # an exception or exit() ends the rank, as a script does; what the cell
            result = _run(self.first, ns, ctx, notebook, track=False)  # assigned dies with the rank
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
                usergroup.release_destroyed()  # idle since the last command: safe to free (usergroup)
                busy.append(True)
                try:
                    answer = _answer(cmd, ns, ctx, notebook, bound)
                finally:
                    busy.clear()
                if answer is not None:
                    flush_streams()
                    ctx.channel.send(answer)
                bound.snapshot()  # idle again: off the next cell's path

    def _own_end(self, rank: int) -> int:
        for r, (read, write) in self.cmd_pipes.items():
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
            old = usergroup.regroup(cmd.generation)
            return messages.Healthy(bound=_bound_to(old, ns))
        return _run(cmd, ns, ctx, notebook, bound=bound)
    except SystemExit as e:
        return messages.Exit(exit_code(e), exit_site(e), "cell", time.time())
    except BaseException as e:  # noqa: BLE001 - the rank lives on; the kernel decides
        report(ctx.channel, "cell", e)
        return None


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
    """The notebook names a command carries (``RunCell``, ``Update``), into the rank's namespace."""
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
    job = CellJob(cmd.source, cmd.filename, outs=cmd.outs, gathers=cmd.gathers, max_value_bytes=cmd.max_value_bytes,
                  post_mortem=cmd.post_mortem, lead=cmd.lead)
    if not track:
        return job.run_in(ns, ctx, notebook)
    before = bound.before(cmd.updates) if bound is not None else _identities(ns)
    try:
        result = job.run_in(ns, ctx, notebook)
    finally:
        assigned = tuple(sorted(k for k, _ in _identities(ns).items() - before.items() if k not in INJECTED))
        if notebook is not None:  # the rank's own now: they travel by value
            for name in assigned:
                notebook.pop(id(ns[name]), None)
    return messages.Result(result.value, result.outs, result.gathers, assigned)


def _identities(ns: dict) -> dict:
    """name -> id of its value, built in C: a notebook's namespace has hundreds of names, a cell binds few."""
    return dict(zip(ns, map(id, ns.values())))


class _Bindings:
    """A pool rank's namespace as each command left it (name -> id), taken while the rank is idle: the
    next cell's names are compared with it, so the cell's own path does not walk the namespace first
    (~45 us of a pool cell here)."""

    def __init__(self, ns: dict):
        self.ns = ns
        self.seen: dict | None = None

    def snapshot(self) -> None:
        self.seen = _identities(self.ns)

    def before(self, received) -> dict:
        """As the cell found it: the notebook values its command brought are not the cell's own bindings."""
        seen = self.seen if self.seen is not None else _identities(self.ns)
        self.seen = None
        seen.update((name, id(self.ns[name])) for name in received if name in self.ns)
        return seen
