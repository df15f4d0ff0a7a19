"""In a rank: ``nbddp.log(step=None, **scalars)``, batched and sent to the kernel as ``messages.Scalars``.

A call only appends to a queue (a fraction of a microsecond: no lock, no conversion, no I/O), so a
training loop can log every step. The rank's flusher thread (rank/stdio.py) takes what is queued every
``SEND_S`` and sends it as one record, one column per name; what is still queued goes before the rank's answer to
its cell (``flush``), so the kernel has all a cell logged when the cell ends. Values are made floats there, not in
the call: a tensor's ``.item()`` costs the caller nothing (a value that is no number is left out, said
once). A tensor is read when it is sent, up to ``SEND_S`` later: log ``loss.item()``, not a tensor a later
step changes in place. Outside a rank (the notebook itself, the same code under torchrun from ``%ddp_export``) a
call does nothing.
"""
from __future__ import annotations

import collections
import math
import os
import sys
import threading
import time

from ..wire.messages import Scalars
from . import profile_session

SEND_S = 0.25  # the kernel redraws at most twice a second: four batches a second keep it live
_queue: collections.deque = collections.deque()  # (step, time, scalars) of each call, in order
_state = {"chan": None, "step": -1, "warned": set()}
_send_lock = threading.Lock()  # one batch at a time (the flusher thread, or a flush before an answer)


def log(step=None, **scalars) -> None:
    """Log ``scalars`` (name=number) at ``step`` (an int: the training step; None: one more than this
    rank's last step): the cell shows them as live charts, one panel per name and one line per rank, and
    ``nbddp.metrics()`` gives them all in the notebook."""
    if _state["chan"] is None:  # no rank here (the notebook, a torchrun script, a DataLoader worker)
        return
    if step is None:
        step = _state["step"] + 1
    if step != _state["step"]:
        _state["step"] = step
        profile_session.step()  # a logged step counts as one for --profile in a loop without an optimizer
    _queue.append((step, time.time(), scalars))


def install(chan) -> None:
    """This process is a rank, its channel ``chan``: calls are sent from now on."""
    _state.update(chan=chan, step=-1)
    _queue.clear()
    os.register_at_fork(after_in_child=_not_a_rank)  # (a DataLoader worker the rank forks)


def _not_a_rank() -> None:
    _state["chan"] = None


def flush() -> None:
    """What is queued, sent now: every ``SEND_S`` from the rank's flusher thread (rank/stdio.py), and before
    the rank answers its cell."""
    chan = _state["chan"]
    if chan is None:
        return
    with _send_lock:  # (the queue looked at under it: a batch the thread took is sent before this returns)
        if not _queue:
            return
        rows = []
        while _queue:
            rows.append(_queue.popleft())
        try:
            record = _columns(rows)
            if record is not None:
                chan.send(record)
        except Exception:  # noqa: BLE001 - the kernel gone, a value no stream can say: the cell goes on
            pass


def _columns(rows: list) -> Scalars | None:
    """Rows as one ``Scalars``: a column per name, NaN where a call did not log it."""
    names: dict[str, list] = {}
    steps, times = [], []
    for step, when, scalars in rows:
        kept = False
        for name, value in scalars.items():
            number = _number(name, value)
            if number is None:
                continue
            column = names.get(name)
            if column is None:
                column = names[name] = [math.nan] * len(steps)
            column.append(number)
            kept = True
        if not kept:
            continue
        steps.append(step)
        times.append(when)
        for column in names.values():
            if len(column) < len(steps):
                column.append(math.nan)
    if not steps:
        return None
    return Scalars(tuple(steps), tuple(times), {name: tuple(column) for name, column in names.items()})


def _number(name: str, value) -> float | None:
    try:
        return float(value)  # a Python number, a numpy scalar, a one-element tensor (its .item())
    except (TypeError, ValueError, OverflowError, RuntimeError):  # not a number (a string, a big tensor, 10**400)
        if name not in _state["warned"]:
            _state["warned"].add(name)
            try:
                print(f"nbddp.log: {name}={type(value).__name__} is not a number: left out of the charts "
                      f"(log a float: {name}=value.item())", file=sys.stderr)
            except (OSError, ValueError):  # a closed stderr
                pass
        return None
