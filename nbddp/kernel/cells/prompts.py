"""In the kernel: the ranks' ``input()`` and pdb prompts, asked in the notebook's input box, one rank at a
time (the rank side is rank/stdin.py).

A rank's ``InputRequest`` waits here for its turn: the rank answered last holds the box for HOLD_S more,
so a pdb session's prompts are never interleaved with another rank's; others wait, in order. The prompt
is labelled ``[rankN] `` and asked the way ``%debug`` asks (ipykernel's ``raw_input``/``getpass``); the
answer goes back on that rank's command pipe. Where the front end has no input box (nbclient,
papermill) the rank gets the ``StdinNotImplementedError`` a plain cell gets. ``serve`` says how long it
waited for the user, so the engine's clocks (--timeout, its health rules) do not count a debugging pause.
"""
from __future__ import annotations

import time

from ...ipy.session import running_shell
from ...wire import messages

HOLD_S = 0.5  # the rank answered last asks again within this: still its turn (a pdb session)


class Prompts:
    def __init__(self, gang):
        self.gang = gang
        self.waiting: list[tuple[int, messages.InputRequest]] = []
        self.holder: int | None = None
        self.hold_until = 0.0

    def on_Message(self, event) -> None:
        rec = event.record
        if isinstance(rec, messages.InputRequest):
            self.waiting.append((event.rank, rec))
        elif isinstance(rec, (messages.Result, messages.Error, messages.Exit)) and event.rank == self.holder:
            self.holder = None  # its cell is over: the box is free at once

    def on_Exited(self, event) -> None:
        self.waiting = [(r, q) for r, q in self.waiting if r != event.rank]
        if self.holder == event.rank:
            self.holder = None

    def refuse(self, why: str) -> None:
        """No prompt may be asked (the cell's rules say ``why``): each one waiting is answered with the error a
        front end without an input box gives, so its rank goes on."""
        waiting, self.waiting = self.waiting, []
        for rank, req in waiting:
            self.gang.command(messages.InputReply(req.id, error="StdinNotImplementedError", message=why),
                              ranks=[rank])

    def due(self) -> float | None:
        """When the next prompt can be asked (the holder's at once, another's after the hold); None if none."""
        if not self.waiting:
            return None
        if self.holder is None or any(r == self.holder for r, _ in self.waiting):
            return time.monotonic()
        return self.hold_until

    def serve(self) -> float:
        """Ask the prompt whose turn it is, if one is due; the seconds spent waiting for the user."""
        due = self.due()
        if due is None or time.monotonic() < due:
            return 0.0
        pick = next(((r, q) for r, q in self.waiting if r == self.holder), self.waiting[0])
        self.waiting.remove(pick)
        rank, req = pick
        start = time.monotonic()
        try:
            reply = messages.InputReply(req.id, value=ask(f"[rank{rank}] {req.prompt}", req.password))
        except Exception as e:  # noqa: BLE001 - the rank raises it, as a plain cell would
            reply = messages.InputReply(req.id, error=type(e).__name__, message=str(e))
        self.gang.command(reply, ranks=[rank])
        self.holder, self.hold_until = rank, time.monotonic() + HOLD_S
        return time.monotonic() - start


def ask(prompt: str, password: bool) -> str:
    """The front end's answer: ipykernel's input request (as ``input()`` in a plain cell), else the terminal."""
    kernel = getattr(running_shell(), "kernel", None)
    if kernel is None:
        import getpass

        return getpass.getpass(prompt) if password else input(prompt)
    return kernel.getpass(prompt) if password else kernel.raw_input(prompt)
