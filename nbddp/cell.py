"""A notebook cell as a job every rank can run: compiled, checked, and (for spawn) shipped by value."""
from __future__ import annotations

import ast
import builtins
import linecache
import types

import cloudpickle

from . import results
from .errors import UsageError

# IPython's own names in the user namespace: never shipped, never needed by a rank
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_oh", "_ih", "_dh", "_i", "_ii", "_iii"}


def split_last_expression(source: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
    """Compile a cell into its body and, if it ends in an expression, that expression (IPython's rule)."""
    try:
        tree = ast.parse(source, filename, "exec")
    except SyntaxError as e:
        raise UsageError(f"the cell does not compile, so nothing was launched:\n{e.__class__.__name__}: {e}") from None
    last = None  # a trailing ';' keeps the expression in the body and silences its value, as in IPython
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return compile(tree, filename, "exec"), last


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
        if name not in user_ns or name in _IPYTHON_NAMES or name.startswith("_i"):
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
    """Runs a cell on a rank with the notebook's globals (the fork's copy, or shipped ones)."""

    def __init__(self, source: str, filename: str, *, outs=(), namespace=None, shipped=None):
        self.source = source
        self.filename = filename
        self.outs = tuple(outs)
        self.namespace = namespace  # fork: the kernel's user_ns itself (each rank has its own copy)
        self.shipped = shipped  # spawn: {name: pickled value}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["namespace"] = None  # the kernel's namespace never travels; spawn uses `shipped`
        return state

    def __call__(self, ctx):
        if self.namespace is not None:
            ns = self.namespace
        else:
            ns = {"__name__": "__main__", "__builtins__": builtins}
            ns.update({k: cloudpickle.loads(v) for k, v in (self.shipped or {}).items()})
        if self.filename not in linecache.cache:
            lines = self.source.splitlines(keepends=True)
            linecache.cache[self.filename] = (len(self.source), None, lines, self.filename)
        ns.update(rank=ctx.rank, local_rank=ctx.local_rank, world_size=ctx.world_size, device=ctx.device)
        body, last = split_last_expression(self.source, self.filename)  # compiled per rank: code objects
        # do not need to travel for spawn, and a compile is ~0.1 ms
        exec(body, ns)
        value = eval(last, ns) if last is not None else None
        if ctx.rank != 0:
            return None
        return pack_results(value, {name: ns[name] for name in self.outs if name in ns},
                            [name for name in self.outs if name not in ns])


def pack_results(value, outs: dict, missing: list[str]) -> dict:
    """Pickle each value on its own, so one that cannot travel is named and the others still arrive."""
    packed = {"value": None, "outs": {}, "errors": {}, "missing": missing}
    for name, obj in [("__value__", value), *outs.items()]:
        try:
            blob = results.dumps(obj)
        except Exception as e:  # noqa: BLE001
            packed["errors"][name] = f"{results.describe(obj)}: {type(e).__name__}: {e}"
            continue
        if name == "__value__":
            packed["value"] = blob
        else:
            packed["outs"][name] = blob
    return packed
