"""A pool's rank: after joining the process group once, it answers the kernel's commands until told to stop.

Each command (channel.RunCell, Call, HealthCheck, Stop) arrives framed on the rank's command pipe; each
gets exactly one answer on the rank's channel (Result, Error, Exit, Healthy). What a cell defines stays
in the rank's namespace for the next one. SIGUSR2 raises KeyboardInterrupt in a running cell (how the
kernel relays Jupyter's interrupt, or frees ranks after a peer failed); between cells it is ignored.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

import cloudpickle

from . import channel, results
from .cell import CellJob, fresh_namespace
from .worker import exit_code, exit_site, flush_streams, report

INJECTED = {"rank", "local_rank", "world_size", "device", "exit", "quit"}
INTERRUPT = signal.SIGUSR2


class PoolServer:
    """The job a pool's ranks run: ``cmd_pipes`` maps each rank to its command pipe (read, write)."""

    def __init__(self, cmd_pipes: dict[int, tuple[int, int]], namespace=None):
        self.cmd_pipes = cmd_pipes
        self.namespace = namespace  # fork: the kernel's user_ns (each rank has its own copy)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["namespace"] = None  # spawn: the notebook's values arrive with each cell that reads them
        return state

    def __call__(self, ctx) -> channel.Result:
        fd = self._own_end(ctx.rank)
        ns = self.namespace if self.namespace is not None else fresh_namespace()
        # what the kernel has too (by reference on the way back); spawn: cloudpickle's class tracking
        notebook = results.notebook_objects(ns) if self.namespace is not None else None
        busy = []

        def interrupt(signum, frame):
            if busy:
                raise KeyboardInterrupt

        signal.signal(INTERRUPT, interrupt)
        reader = channel.Reader()
        while True:
            for cmd, _ in _next_commands(fd, reader):
                if isinstance(cmd, channel.Stop):
                    return channel.Result()
                busy.append(True)
                try:
                    answer = self._answer(cmd, ns, ctx, notebook)
                finally:
                    busy.clear()
                if answer is not None:
                    flush_streams()
                    ctx.channel.send(answer)

    def _own_end(self, rank: int) -> int:
        for r, (read, write) in self.cmd_pipes.items():
            os.close(write)
            if r != rank:
                os.close(read)
        return self.cmd_pipes[rank][0]

    def _answer(self, cmd, ns: dict, ctx, notebook):
        try:
            if isinstance(cmd, channel.HealthCheck):
                import torch.distributed as dist

                dist.barrier()
                return channel.Healthy()
            if isinstance(cmd, channel.Call):
                return cloudpickle.loads(cmd.job)(ctx)
            return self._run_cell(cmd, ns, ctx, notebook)
        except SystemExit as e:
            return channel.Exit(exit_code(e), exit_site(e), "cell", time.time())
        except BaseException as e:  # noqa: BLE001 - the rank lives on; the kernel decides
            report(ctx.channel, "cell", e)
            return None

    @staticmethod
    def _run_cell(cmd: channel.RunCell, ns: dict, ctx, notebook) -> channel.Result:
        for name, blob in cmd.updates.items():
            ns[name] = cloudpickle.loads(blob)
            if notebook is not None:  # the notebook has this very value under this name
                notebook[id(ns[name])] = (name, ns[name])
        before = {k: id(v) for k, v in ns.items()}
        job = CellJob(cmd.source, cmd.filename, outs=cmd.outs, gathers=cmd.gathers,
                      max_value_bytes=cmd.max_value_bytes)
        try:
            result = job.run_in(ns, ctx, notebook)
        finally:
            assigned = tuple(k for k, v in ns.items() if before.get(k) != id(v) and k not in INJECTED)
            if notebook is not None:  # the rank's own now: they travel by value
                for name in assigned:
                    notebook.pop(id(ns[name]), None)
        return dataclasses.replace(result, assigned=assigned)


def _next_commands(fd: int, reader: channel.Reader) -> list:
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except InterruptedError:
            continue
        if not data:  # the kernel closed the pipe: it is gone or stopped the pool
            sys.exit(0)
        records = reader.feed(data)
        if records:
            return records
