"""A cell's code as IPython compiles it, on both sides: split into body and last expression (top-level
``await`` allowed), the names it reads, and which notebook names are IPython's own."""
from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
import types

from ..errors import UsageError
from . import cells, tracebacks

# IPython's own names in the user namespace: never shipped, never needed by a rank
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_oh", "_ih", "_dh"}


_IPYTHON_HISTORY = re.compile(r"_i{1,3}$|_i\d+$|_\d+$")  # _i, _ii, _iii, _iN, _N: IPython's history


def notebook_name(name: str) -> bool:
    """A name the user's code bound, not one of IPython's own (never sent, never needed by a rank)."""
    return name not in _IPYTHON_NAMES and not _IPYTHON_HISTORY.match(name)


# top-level `await` compiles, as in a notebook cell (IPython's autoawait); a cell without one compiles
# to the same code as before, and only one that has one is run in an event loop (run_async)
TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)


def silenced(source: str) -> bool:
    """The cell ends in ``;``, which silences its last expression (IPython's rule: its DisplayHook's
    ``semicolon_at_end_of_expression``, written here because IPython 7.x has no such function)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    skip = (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    last = next((t for t in reversed(tokens) if t.type not in skip), None)
    return last is not None and last.type == tokenize.OP and last.string == ";"


def split_last_expression(source: str, filename: str, labels=None) -> tuple[types.CodeType, types.CodeType | None]:
    """Compile a cell into its body and, if it ends in an expression, that expression (IPython's rule).
    ``labels``: the kernel's cell labels, for a syntax error shown as IPython shows it."""
    try:
        tree = ast.parse(source, filename, "exec")
        last = None  # a trailing ';' keeps the expression in the body and silences its value, as in IPython
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not silenced(source):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval", flags=TOP_LEVEL_AWAIT)
        return compile(tree, filename, "exec", flags=TOP_LEVEL_AWAIT), last
    except SyntaxError as e:
        raise UsageError("the cell does not compile, so nothing was launched:\n"
                         + tracebacks.syntax_error(e, labels or {})) from None


def is_async(code: types.CodeType | None) -> bool:
    """Compiled from a cell with a top-level ``await`` (IPython's test, async_helpers._should_be_async)."""
    return code is not None and bool(code.co_flags & inspect.CO_COROUTINE)


def names_bound(source: str) -> set[str]:
    """The names a notebook cell binds at its top level (assignments, ``def``, ``class``, imports, ``for``
    and ``with`` targets, ``del``); none if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
            return  # their bodies bind names of their own scope
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            found.add(node.id)
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_used(const)
    return names


COMPILED_KEPT = 64  # cells kept compiled


class Compiled:
    """The cells ``%%ddp`` ran, as IPython runs them, kept by their text (``COMPILED_KEPT`` of them)."""

    def __init__(self):
        self.kept: dict[str, tuple] = {}  # cell text -> (source, names read, execution count, file name)

    def get(self, shell, cell):
        """The cell as IPython runs it: its source (transformed), file name (Cell In[n]) and the names it
        reads. A cell run again (a pool's habit) is transformed and checked once: ~0.5 ms of a pool cell."""
        known = self.kept.get(cell)
        source = known[0] if known else "\n" + shell.transform_cell(cell)  # line numbers count the %%ddp line
        number = cells.running(shell)  # one rule on every IPython: execution_count differs
        if known and known[2] == number:  # registered already (ipykernel hashes the cell in pure Python)
            return source, known[3], known[1]
        filename = shell.compile.cache(source, number, raw_code=cell)
        if known:
            self.kept[cell] = (source, known[1], number, filename)
            return source, filename, known[1]
        # a syntax error launches nothing, and shows as IPython shows it (Cell In[n], the line, the caret)
        body, last = split_last_expression(source, filename, tracebacks.cell_labels(shell))
        names = names_used(body) | (names_used(last) if last else set())
        if len(self.kept) >= COMPILED_KEPT:
            self.kept.pop(next(iter(self.kept)))
        self.kept[cell] = (source, names, number, filename)
        return source, filename, names

