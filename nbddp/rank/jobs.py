"""What a rank runs for a command: a notebook cell (``CellJob``: its last expression, ``--out`` and
``--gather`` names back as a ``Result``) or a function (``CallJob``: ``nbddp.launch``, ``Pool.run``)."""
from __future__ import annotations

import builtins
import functools
import inspect
import linecache
import sys
import types

from ..ipy.cellcode import is_async, split_last_expression
from ..wire import values
from ..wire.messages import Item, Result
from . import copywatch, debug

_LINES: dict[str, tuple] = {}  # a cell's file name -> the linecache entry this rank made for its text


def run_async(body: types.CodeType, last: types.CodeType | None, ns: dict):
    """A cell with top-level ``await``: body and last expression awaited in one fresh event loop (a
    forked rank must never touch the kernel's running loop), closed when the cell ends."""
    import asyncio

    @debug.entry
    async def cell():
        done = eval(body, ns)
        if inspect.iscoroutine(done):
            await done
        value = eval(last, ns) if last is not None else None
        return await value if is_async(last) else value

    return asyncio.run(cell())


class CellJob:
    """Runs a cell on a rank in a namespace and returns its ``Result``: rank 0's last expression and
    ``outs``, every rank's ``gathers``."""

    def __init__(self, source: str, filename: str, *, outs=(), gathers=(), max_value_bytes: int,
                 post_mortem: bool = False, lead: int = 0):
        self.lead = lead  # the rank whose last expression and outs come back
        self.post_mortem = post_mortem  # IPython's %pdb: pdb at an exception's frame before it is reported
        self.source = source
        self.filename = filename
        self.outs = tuple(outs)
        self.gathers = tuple(gathers)
        self.max_value_bytes = max_value_bytes

    @debug.entry
    def run_in(self, ns: dict, ctx, notebook) -> Result:
        """Run in ``ns``; ``notebook``: the objects (values.notebook_objects) the kernel has as well,
        which travel back by reference."""
        entry = _LINES.get(self.filename)
        if entry is None or linecache.cache.get(self.filename) is not entry:
            # (while the debugger panel is on, the name is the whole cell's, under which the kernel, whose
            # linecache a forked rank inherits, cached another text: the magic's call)
            lines = self.source.splitlines(keepends=True)
            entry = (len(self.source), None, lines, self.filename)
            linecache.cache[self.filename] = _LINES[self.filename] = entry
        ns.update(rank=ctx.rank, local_rank=ctx.local_rank, world_size=ctx.world_size, device=ctx.device)
        ns.update(exit=sys.exit, quit=sys.exit)  # as in a script: ends this rank's cell
        body, last = _compiled(self.source, self.filename)  # in the rank: code objects never travel
        watch = copywatch.CopyWatch(copywatch.watched((body, last), ns), ns)
        try:
            with watch:
                if is_async(body) or is_async(last):
                    value = run_async(body, last, ns)
                else:
                    exec(body, ns)
                    value = eval(last, ns) if last is not None else None
        except BaseException as e:  # the cell's own failure, SystemExit too: noted, re-raised
            debug.failed(e, ctx.rank, self.post_mortem)
            raise
        _show_figures()

        def pack(obj):
            return values.pack(obj, max_bytes=self.max_value_bytes, notebook=notebook)

        def named(names):
            return {n: pack(ns[n]) if n in ns else _never_defined(n) for n in names}

        gathers = named(self.gathers)
        if ctx.rank != self.lead:
            return Result(gathers=gathers, copied=watch.copied)
        item = pack(value) if value is not None else None
        if item is not None and item.problem:
            _display_instead(value, item.problem)
            item = None
        return Result(value=item, outs=named(self.outs), gathers=gathers, copied=watch.copied)


def in_namespace(value, ns: dict):
    """A function or class the notebook defined, sent to a pool's rank, runs against the rank's globals
    (what the ranks built, the latest notebook values), as one defined before the fork does."""
    if getattr(value, "__module__", None) != "__main__":
        return value
    if isinstance(value, types.FunctionType):
        return _rebound(value, ns)
    if isinstance(value, type):
        for attr, member in list(vars(value).items()):
            if isinstance(member, types.FunctionType):
                setattr(value, attr, _rebound(member, ns))
            elif isinstance(member, (staticmethod, classmethod)) and isinstance(member.__func__, types.FunctionType):
                setattr(value, attr, type(member)(_rebound(member.__func__, ns)))
            elif isinstance(member, property):
                parts = [_rebound(f, ns) if isinstance(f, types.FunctionType) else f
                         for f in (member.fget, member.fset, member.fdel)]
                setattr(value, attr, property(*parts, member.__doc__))
    return value


def _rebound(func: types.FunctionType, ns: dict) -> types.FunctionType:
    new = types.FunctionType(func.__code__, ns, func.__name__, func.__defaults__, func.__closure__)
    new.__kwdefaults__ = func.__kwdefaults__
    new.__dict__.update(func.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = func.__qualname__, func.__module__, func.__doc__
    new.__annotations__ = func.__annotations__
    return new


@functools.lru_cache(maxsize=64)
def _compiled(source: str, filename: str):
    """A pool's cell run again has the same source and file name (the kernel names a cell by its hash):
    compiled once (~0.1 ms of a pool cell's ~1 ms)."""
    return split_last_expression(source, filename)


def fresh_namespace() -> dict:
    return {"__name__": "__main__", "__builtins__": builtins}


def _never_defined(name: str):
    return Item(problem=values.NEVER_DEFINED)


def _show_figures() -> None:
    """As a notebook cell ends: figures drawn under the inline backend but never shown are shown."""
    inline = sys.modules.get("matplotlib_inline.backend_inline")
    if inline is not None and "inline" in str(sys.modules["matplotlib"].get_backend()):
        inline.flush_figures()


def _display_instead(value, problem: str) -> None:
    """A last expression that cannot travel is shown from the rank (its rich display) instead."""
    from IPython.display import display

    display(value)
    print(f"(Out[] stays empty: the last expression's value {problem})", file=sys.stderr)


class CallJob:
    """``fn(*args)`` on a rank; its return value comes back (``nbddp.launch``, ``Pool.run``)."""

    def __init__(self, fn, args, max_value_bytes: int):
        self.fn, self.args, self.max_value_bytes = fn, args, max_value_bytes

    @debug.entry
    def __call__(self, ctx) -> Result:
        return Result(value=values.pack(self.fn(*self.args), max_bytes=self.max_value_bytes))
