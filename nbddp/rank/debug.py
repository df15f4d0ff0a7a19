"""In a rank: pdb in the notebook. ``breakpoint()``, ``pdb.set_trace()`` and
``torch.distributed.breakpoint(rank=N)`` stop the rank in pdb, its prompt in the notebook's input box
(rank/stdin.py); with IPython's ``%pdb on`` a cell's exception opens pdb at the failing frame before
the rank reports it (``failed``); a pool keeps its last failure's traceback until the next cell, for
``%ddp debug`` (``post_mortem_last``)."""
from __future__ import annotations

import pdb
import sys
import traceback

last_failure: BaseException | None = None


def install() -> None:
    """Python's own breakpoint hook (it honours PYTHONBREAKPOINT) and a pdb that reads sys.stdin (the
    notebook) for torch.distributed.breakpoint, whose own reopens /dev/stdin (a rank's is /dev/null)."""
    sys.breakpointhook = sys.__breakpointhook__
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "_make_distributed_pdb"):
        dist._make_distributed_pdb = pdb.Pdb


def new_cell() -> None:
    """A new cell: the last one's frames are let go."""
    global last_failure
    last_failure = None


def failed(exc: BaseException, rank: int, post_mortem: bool) -> None:
    """A cell's exception, before the rank reports it: kept for ``%ddp debug``; with ``%pdb on``, pdb at
    the failing frame first (an interrupt or exit() is not debugged)."""
    global last_failure
    if isinstance(exc, (KeyboardInterrupt, SystemExit, pdb.bdb.BdbQuit)):
        return
    last_failure = exc
    if post_mortem:
        _debug(exc, f"rank {rank}: post-mortem (%pdb is on): pdb at the failing frame; the other ranks wait. "
                    "`c` or `q` ends it, then the cell fails as usual.")


def post_mortem_last(rank: int) -> None:
    """``%ddp debug``: pdb in the rank's last failed cell."""
    if last_failure is None:
        raise RuntimeError(f"rank {rank} kept no failure: its last cell did not fail here (a failure's frames "
                           "are kept until the next cell), or it was interrupted.")
    _debug(last_failure, f"rank {rank}: post-mortem of its last failed cell. `c` or `q` ends it.")


def _debug(exc: BaseException, header: str) -> None:
    text = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    print(f"{text}\n{header}", file=sys.stderr, flush=True)
    debugger = pdb.Pdb()
    debugger.reset()
    debugger.interaction(None, exc.__traceback__)
