"""In a rank: pdb in the notebook. ``breakpoint()``, ``pdb.set_trace()`` and
``torch.distributed.breakpoint(rank=N)`` stop the rank in pdb, its prompt in the notebook's input box
(rank/stdin.py); with IPython's ``%pdb on`` a cell's exception opens pdb at the failing frame before
the rank reports it (``failed``); a pool keeps its last failure's traceback until the next cell, for
``%ddp debug`` (``post_mortem_last``).

The debugger's stack starts at the user's code, as IPython's own starts at the cell's frame: the frames
of nbddp that run the cell (the worker, ``server.py``, ``jobs.py``'s exec) are cut from below it
(``Debugger.get_stack``), so ``where`` shows the cell first and ``up`` there says "Oldest frame". A cut,
not IPython's ``__tracebackhide__``: that hides frames from IPython's debugger only, and its ``up`` then
says "all frames above skipped" where a plain cell's says "Oldest frame"."""
from __future__ import annotations

import pdb
import sys
import traceback

last_failure: BaseException | None = None
ENTRIES: set = set()  # code objects of nbddp's frames that call the user's code (``entry``)
Debugger = None  # the rank's debugger class (``install``)


def entry(func):
    """Marks ``func`` as where nbddp calls the user's code: the debugger's stack starts above its frame."""
    ENTRIES.add(func.__code__)
    return func


def user_start(stack) -> int:
    """Index in ``stack`` (pdb's ``(frame, lineno)`` list, oldest first) of the user's first frame: the one
    above the newest nbddp entry frame; 0 where there is none (a thread of the user's, a library's)."""
    marks = [i for i, (frame, _) in enumerate(stack) if frame.f_code in ENTRIES]
    return marks[-1] + 1 if marks and marks[-1] + 1 < len(stack) else 0


def _debugger_class(base: type) -> type:
    class Debugger(base):
        """The debugger in use here (IPython's in a forked rank, as in the kernel; pdb's in a spawned one)
        with nbddp's frames cut from the bottom of its stack."""

        def get_stack(self, f, t):
            stack, index = super().get_stack(f, t)
            cut = user_start(stack)
            if cut > index:  # stopped inside nbddp itself: nothing to hide
                return stack, index
            return stack[cut:], index - cut

    return Debugger


def set_trace(frame=None, *, header=None):
    """``pdb.set_trace()`` and ``breakpoint()`` (PYTHONBREAKPOINT's default) in a rank."""
    debugger = Debugger()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame or sys._getframe().f_back)


def install() -> None:
    """Python's own breakpoint hook (it honours PYTHONBREAKPOINT) over ``pdb.set_trace``, and one debugger
    class for pdb, IPython's ``set_trace`` and torch.distributed.breakpoint, whose own reopens /dev/stdin (a
    rank's is /dev/null): each reads sys.stdin (the notebook) and starts at the user's frames."""
    global Debugger
    base = pdb.Pdb if Debugger is None or pdb.Pdb is not Debugger else Debugger.__mro__[1]
    Debugger = _debugger_class(base)
    pdb.Pdb, pdb.set_trace = Debugger, set_trace
    ipython_debugger = sys.modules.get("IPython.core.debugger")
    if ipython_debugger is not None:
        ipython_debugger.Pdb = Debugger
    sys.breakpointhook = sys.__breakpointhook__
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "_make_distributed_pdb"):
        dist._make_distributed_pdb = Debugger


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
    debugger = (Debugger or pdb.Pdb)()
    debugger.reset()
    debugger.interaction(None, exc.__traceback__)
