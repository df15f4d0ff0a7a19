"""What a user reads of a traceback or a stack: the notebook's cells named as IPython names them
(``Cell In[n], line L``, for every cell the kernel compiled, not only the running one), and only the
user's frames: not nbddp's, not the kernel's beneath the cell, not asyncio's, threading's or
selectors' machinery.

In a rank: ``user_traceback`` (an exception, for the channel). In the kernel: ``CellLabels`` and
``relabel`` (file names), ``syntax_error`` (a cell that does not compile), ``parse_stacks`` and
``user_stack`` (faulthandler's dump of a rank, at --timeout or an interrupt).
"""
from __future__ import annotations

import linecache
import os
import re
import traceback
from collections.abc import Mapping

from . import cells

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # nbddp/, every side
# the machinery that runs a cell, a thread or an event loop: never where the user's code is
_STDLIB = os.path.dirname(os.__file__)  # not imported for their paths: a spawned rank stays light
_MACHINERY = (_PKG_DIR, os.path.join(_STDLIB, "asyncio") + os.sep, os.path.join(_STDLIB, "threading.py"),
              os.path.join(_STDLIB, "selectors.py"), "<frozen runpy>")


def ours(filename: str) -> bool:
    return filename.startswith(_PKG_DIR)


def machinery(filename: str) -> bool:
    return filename.startswith(_MACHINERY)


class CellLabels(Mapping):
    """File name -> ``Cell In[n]`` for every cell the kernel's compiler cached (IPython's own labels:
    ``CachingCompiler.format_code_name``), read when a traceback is shown, so building it costs nothing.
    ``numbers``: file name -> cell number (``cells.numbers``: a live dict that grows with each cell)."""

    def __init__(self, numbers=None):
        self._numbers = numbers if numbers is not None else {}

    def __getitem__(self, filename: str) -> str:
        return f"Cell In[{self._numbers[filename]}]"

    def __iter__(self):
        return iter(self._numbers)

    def __len__(self) -> int:
        return len(self._numbers)


def cell_labels(shell=None) -> Mapping:
    """The labels of the running IPython session's cells (empty outside IPython)."""
    if shell is None:
        from .session import running_shell

        shell = running_shell()
    return CellLabels(cells.numbers(shell))


_FILE = re.compile(r'File "([^"\n]+)", line')


def relabel(text: str, labels: Mapping) -> str:
    """``File "/tmp/ipykernel_1/123.py", line 4`` -> ``Cell In[3], line 4`` for every cell in ``labels``."""
    if not labels:
        return text
    return _FILE.sub(lambda m: f"{labels[m.group(1)]}, line" if m.group(1) in labels else m.group(0), text)


# -- in a rank: an exception as the user should read it ---------------------------------------------
def user_frames(frames: list) -> list:
    """The frames of an exception's traceback (outermost first) that are the user's: from the first one
    outside nbddp's and the event loop's machinery on (how the rank got to the cell is not the user's),
    without nbddp's own handler at the end (the pool's interrupt)."""
    start = 0
    while start < len(frames) and machinery(frames[start].filename):
        start += 1
    end = len(frames)
    while end > start and ours(frames[end - 1].filename):
        end -= 1
    return frames[start:end]


def user_traceback(exc: BaseException) -> str:
    try:
        te = traceback.TracebackException.from_exception(exc)
        te.stack = traceback.StackSummary.from_list(user_frames(list(te.stack)))
        return "".join(te.format())
    except Exception:  # noqa: BLE001 - an odd exception still reaches the kernel, untrimmed
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def innermost_user_frame(exc: BaseException):
    frames = user_frames(traceback.extract_tb(exc.__traceback__))
    frames = [f for f in frames if not machinery(f.filename)]
    return frames[-1] if frames else None


# -- in the kernel: a cell that does not compile --------------------------------------------------
def syntax_error(e: SyntaxError, labels: Mapping) -> str:
    """As IPython shows it: ``Cell In[n], line L``, the line, the caret, ``SyntaxError: ...``."""
    return relabel("".join(traceback.format_exception_only(type(e), e)).rstrip("\n"), labels)


# -- in the kernel: a rank's stack, from faulthandler's dump ----------------------------------------
# a stack dump's lines (faulthandler at an interrupt or --timeout, a traceback): never a rank's "last line"
DUMP_LINE = re.compile(r"\s*(File( \"|\s*$)|Thread 0x|Current thread 0x|Stack \(most recent call first\)|"
                       r"Traceback \(most recent call last\)|Fatal Python error|<no Python frame>)")
_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ .*:$|^Stack \(most recent call first\):$")
_FRAME = re.compile(r'^  File "([^"\n]+)", line (\d+) in (.+)$')


def parse_stacks(dump: str) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """faulthandler's text -> [(thread header, [(file, line, function), ...most recent first]), ...]."""
    threads = []
    for line in dump.splitlines():
        if _HEADER.match(line):
            threads.append((line, []))
        elif (m := _FRAME.match(line)) and threads:
            threads[-1][1].append((m.group(1), int(m.group(2)), m.group(3)))
    return threads


def _user_part(frames: list) -> list:
    """Most recent first. Below the user's code lies how it was reached: nbddp's frames (and beneath
    them the kernel's own stack, inherited at fork); above it, nbddp's wrappers and the machinery."""
    outer = list(reversed(frames))  # outermost first
    first_ours = next((i for i, f in enumerate(outer) if ours(f[0])), None)
    if first_ours is not None:
        start = first_ours
        while start < len(outer) and machinery(outer[start][0]):
            start += 1
        outer = outer[start:]
    return [f for f in reversed(outer) if not machinery(f[0])]


def user_stack(dump: str, labels: Mapping) -> list[str]:
    """The user's frames of each thread that has some, most recent first, each with its source line;
    the thread headers only when more than one thread is left. Empty if the dump has none."""
    kept = [(header, _user_part(frames)) for header, frames in parse_stacks(dump)]
    kept = [(header, frames) for header, frames in kept if frames]
    lines = []
    for header, frames in kept:
        if len(kept) > 1:
            lines.append("  " + header)
        for frame in frames:
            lines += ["  " + _place(frame, labels)] + _source(frame)
    return lines


_TB_FRAME = re.compile(r'^  File "([^"\n]+)", line (\d+), in (.+)$', re.M)


def where(frames: list, labels: Mapping) -> str | None:
    """Where a rank was: the innermost line of a cell in ``frames`` (most recent first) if there is
    one, else the innermost frame of the user's code; None if there is none."""
    frames = _user_part(frames)
    frame = next((f for f in frames if f[0] in labels), frames[0] if frames else None)
    if frame is None:
        return None
    source = _source(frame)
    return _place(frame, labels, ", in ") + (": " + source[0].strip() if source else "")


def awaiting(frames: list) -> bool:
    """The stack of a cell with top-level ``await`` waiting in its event loop: the cell's coroutine is
    not on the stack while it waits, so no frame of it can be shown."""
    return any(ours(f) and name == "run_async" for f, _, name in frames)


def main_thread(dump: str) -> list:
    """The frames of the rank's main thread (the one in worker.run_rank; the signal that asked for the
    dump may have landed on another thread), most recent first."""
    threads = parse_stacks(dump)
    runs_rank = [frames for _, frames in threads if any(ours(f) and name == "run_rank" for f, _, name in frames)]
    current = [frames for header, frames in threads if header.startswith(("Current", "Stack"))]
    return (runs_rank or current or [[]])[0]


_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_WRAPPERS = {"wrapper", "inner", "_exception_logger", "_time_logger"}


def collective(frames: list) -> str | None:
    """The torch.distributed call a stack (most recent first) is inside, as the user's code called it
    (``barrier``, ``all_reduce``...); None if it is not in torch.distributed."""
    called = None
    for filename, _, name in frames:
        if _DISTRIBUTED in filename:
            called = name if name not in _WRAPPERS else called
        elif called is not None:
            return called
    return called


def traceback_frames(text: str) -> list:
    """A formatted traceback's frames, most recent first (as faulthandler lists them)."""
    return [(f, int(n), name) for f, n, name in reversed(_TB_FRAME.findall(text))]


def _place(frame, labels: Mapping, sep: str = " in ") -> str:
    """faulthandler's ``line 5 in f`` by default; a traceback's ``line 5, in f`` with ``sep=", in "``."""
    filename, lineno, name = frame
    head = f"{labels[filename]}, line {lineno}" if filename in labels else f'File "{_library(filename)}", line {lineno}'
    return f"{head}{sep}{name}"


_INSTALLED = re.compile(r".*/(?:site|dist)-packages/")


def _library(filename: str) -> str:
    """An installed library's file as its import path reads (``torch/distributed/distributed_c10d.py``): the
    same on every machine, and the part a reader looks for; the user's own files keep their whole path."""
    return _INSTALLED.sub("", filename)


def _source(frame) -> list[str]:
    line = linecache.getline(frame[0], frame[1]).strip()
    return [f"    {line}"] if line else []
