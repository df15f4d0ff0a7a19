"""Every error nbddp raises: what happened, on which rank, why, and what to do.

Errors that IPython shows carry ``_render_traceback_`` so a failed cell shows one readable screen
(the rank's own traceback into the cell source) instead of nbddp's internals.
"""
from __future__ import annotations


class NbddpError(RuntimeError):
    """Base of nbddp's errors. ``str(err)`` is the whole message, fix included."""

    def _render_traceback_(self) -> list[str]:
        head = f"\x1b[0;31m{type(self).__name__}\x1b[0m: "
        lines = str(self).splitlines() or [""]
        return [head + lines[0], *lines[1:]]


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
