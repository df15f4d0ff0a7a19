"""Every error nbddp raises: what happened, on which rank, why, and what to do.

Errors that IPython shows carry ``_render_traceback_`` so a failed cell shows one readable screen
(the rank's own traceback into the cell source) instead of nbddp's internals.
"""
from __future__ import annotations


class NbddpError(RuntimeError):
    """Base of nbddp's errors. ``str(err)`` is the whole message, fix included."""

    def _render_traceback_(self) -> list[str]:
        return _render(type(self).__name__, str(self))


class UsageError(NbddpError):
    """Bad input: nothing was launched and nothing in the notebook changed."""


class CudaInitialisedError(UsageError):
    """The kernel already holds a CUDA context, so forked ranks could not use the GPU."""


class RankFailure(NbddpError):
    """One rank failed (exception, signal, exit code or time limit); the others were stopped."""

    def __init__(self, message: str, *, rank: int | None, cause: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.cause = cause
        self.stacks = stacks or {}


class ResultError(NbddpError):
    """The run finished but a value could not be brought back to the notebook."""


def _render(name: str, message: str) -> list[str]:
    lines = message.splitlines() or [""]
    return [f"\x1b[0;31m{name}\x1b[0m: " + lines[0], *lines[1:]]


def interrupt(message: str) -> KeyboardInterrupt:
    """A KeyboardInterrupt (its type, ename and every ``except KeyboardInterrupt`` unchanged) that IPython
    shows as ``message`` (which ranks ran, where each was) instead of a traceback through nbddp's wait loop."""
    exc = KeyboardInterrupt(message)
    exc._render_traceback_ = lambda: _render("KeyboardInterrupt", message)
    return exc
