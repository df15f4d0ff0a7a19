"""A notebook cell as a job every rank can run: compiled, checked, and (for spawn) shipped by value."""
from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import re
import sys
import types

import cloudpickle

from . import results, tracebacks
from .channel import Result
from .errors import UsageError

# IPython's own names in the user namespace: never shipped, never needed by a rank
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_oh", "_ih", "_dh"}
_IPYTHON_HISTORY = re.compile(r"_i{1,3}$|_i\d+$|_\d+$")  # _i, _ii, _iii, _iN, _N: IPython's history

# top-level `await` compiles, as in a notebook cell (IPython's autoawait); a cell without one compiles
# to the same code as before, and only one that has one is run in an event loop (run_async)
TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)


def split_last_expression(source: str, filename: str, labels=None) -> tuple[types.CodeType, types.CodeType | None]:
    """Compile a cell into its body and, if it ends in an expression, that expression (IPython's rule).
    ``labels``: the kernel's cell labels, for a syntax error shown as IPython shows it."""
    try:
        tree = ast.parse(source, filename, "exec")
        last = None  # a trailing ';' keeps the expression in the body and silences its value, as in IPython
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval", flags=TOP_LEVEL_AWAIT)
        return compile(tree, filename, "exec", flags=TOP_LEVEL_AWAIT), last
    except SyntaxError as e:
        raise UsageError("the cell does not compile, so nothing was launched:\n"
                         + tracebacks.syntax_error(e, labels or {})) from None


def is_async(code: types.CodeType | None) -> bool:
    """Compiled from a cell with a top-level ``await`` (IPython's test, async_helpers._should_be_async)."""
    return code is not None and bool(code.co_flags & inspect.CO_COROUTINE)


def run_async(body: types.CodeType, last: types.CodeType | None, ns: dict):
    """A cell with top-level ``await``: body and last expression awaited in one fresh event loop (a
    forked rank must never touch the kernel's running loop), closed when the cell ends."""
    import asyncio

    async def cell():
        done = eval(body, ns)
        if inspect.iscoroutine(done):
            await done
        value = eval(last, ns) if last is not None else None
        return await value if is_async(last) else value

    return asyncio.run(cell())


def names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_used(const)
    return names


def ship_globals(source: str, filename: str, user_ns: dict) -> dict[str, bytes]:
    """The globals a spawned rank needs, each pickled by value; an unpicklable one is named."""
    body, last = split_last_expression(source, filename)
    wanted = names_used(body) | (names_used(last) if last else set())
    shipped = {}
    for name in sorted(wanted):
        if name not in user_ns or name in _IPYTHON_NAMES or _IPYTHON_HISTORY.match(name):
            continue
        if hasattr(builtins, name) and user_ns[name] is getattr(builtins, name):
            continue
        try:
            shipped[name] = cloudpickle.dumps(user_ns[name])
        except Exception as e:  # noqa: BLE001
            raise UsageError(
                f"--start-method spawn must send the global `{name}` ({results.describe(user_ns[name])}) to every "
                f"rank, but it cannot be pickled:\n  {type(e).__name__}: {e}\n"
                f"Create `{name}` inside the cell, or use --start-method fork (it shares the notebook's objects)."
            ) from None
    return shipped


class CellJob:
    """Runs a cell on a rank with the notebook's globals (the fork's copy, or shipped ones) and returns
    its ``Result``: rank 0's last expression and ``outs``, every rank's ``gathers``."""

    def __init__(self, source: str, filename: str, *, outs=(), gathers=(), max_value_bytes: int,
                 namespace=None, shipped=None):
        self.source = source
        self.filename = filename
        self.outs = tuple(outs)
        self.gathers = tuple(gathers)
        self.max_value_bytes = max_value_bytes
        self.namespace = namespace  # fork: the kernel's user_ns itself (each rank has its own copy)
        self.shipped = shipped  # spawn: {name: pickled value}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["namespace"] = None  # the kernel's namespace never travels; spawn uses `shipped`
        return state

    def __call__(self, ctx) -> Result:
        if self.namespace is not None:
            ns = self.namespace
            notebook = results.notebook_objects(ns)  # before the cell: what may travel by reference
        else:
            ns = fresh_namespace()
            ns.update({k: cloudpickle.loads(v) for k, v in (self.shipped or {}).items()})
            notebook = None  # spawn: cloudpickle's own class tracking restores the notebook's classes
        return self.run_in(ns, ctx, notebook)

    def run_in(self, ns: dict, ctx, notebook) -> Result:
        """Run in ``ns``; ``notebook``: the objects (results.notebook_objects) the kernel has as well,
        which travel back by reference."""
        if self.filename not in linecache.cache:
            lines = self.source.splitlines(keepends=True)
            linecache.cache[self.filename] = (len(self.source), None, lines, self.filename)
        ns.update(rank=ctx.rank, local_rank=ctx.local_rank, world_size=ctx.world_size, device=ctx.device)
        ns.update(exit=sys.exit, quit=sys.exit)  # as in a script: ends this rank's cell
        body, last = split_last_expression(self.source, self.filename)  # compiled per rank: code objects
        # do not need to travel for spawn, and a compile is ~0.1 ms
        if is_async(body) or is_async(last):
            value = run_async(body, last, ns)
        else:
            exec(body, ns)
            value = eval(last, ns) if last is not None else None
        _show_figures()

        def pack(obj):
            return results.pack(obj, max_bytes=self.max_value_bytes, notebook=notebook)

        def named(names):
            return {n: pack(ns[n]) if n in ns else _never_defined(n) for n in names}

        gathers = named(self.gathers)
        if ctx.rank != 0:
            return Result(gathers=gathers)
        item = pack(value) if value is not None else None
        if item is not None and item.problem:
            _display_instead(value, item.problem)
            item = None
        return Result(value=item, outs=named(self.outs), gathers=gathers)


def fresh_namespace() -> dict:
    return {"__name__": "__main__", "__builtins__": builtins}


NEVER_DEFINED = "never defined"


def _never_defined(name: str):
    return results.Item(problem=NEVER_DEFINED)


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
