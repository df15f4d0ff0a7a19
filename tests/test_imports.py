"""The package's import graph, read from the source with ``ast``: every import counts, a function's lazy
import as much as a module's own (a lazy import hides a cycle; it does not remove it). Three rules:
no module-level cycle, no package importing one above it (the layers of docs/architecture.md's "Where
code runs" table), and no module reaching for another module's private (``_name``) names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nbddp"

# What each part of the package may import, from docs/architecture.md's "Where code runs" table. A part is
# a subpackage (``kernel``) or a module of the top package (``errors``); a ``part.module`` key narrows a
# rule to one module (export reads only the options table and the device specs of the kernel side).
MAY_IMPORT = {
    "errors": set(),
    "units": set(),  # how sizes and ranks are written: every part may use it
    "timeline": set(),  # the failure timeline's deadlines: every part may read them
    "wire": {"errors", "units"},
    "hw": {"errors", "units", "timeline"},
    "ipy": {"hw", "errors", "units"},
    "rank": {"wire", "ipy", "hw", "errors", "units", "timeline"},
    "views": {"wire", "ipy", "hw", "errors", "units"},
    "kernel": {"rank", "views", "wire", "ipy", "hw", "errors", "units", "timeline"},
    "export": {"kernel.options", "kernel.devices", "ipy", "errors", "units"},
    "cluster": {"kernel", "rank", "views", "wire", "ipy", "hw", "errors", "units", "timeline"},
    "keeper": {"wire", "errors", "units", "timeline"},  # a kept pool's keeper, a process of its own: no torch
    "integrations": {"rank"},  # the trainers' hooks, in a rank: nbddp.log (rank/metrics_log.py) only
    # the public API, the command line and the demo sit on top
    "__init__": {"*"}, "cli": {"*"}, "demo": {"*"},
}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name a ``from X import`` names as X (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str, path: Path, known: dict) -> list[tuple[str, str | None, int]]:
    """Each import of a package module in ``module``, anywhere in it: (the module imported, the name
    taken from it or None for the module itself, line). ``from a import b`` where ``a.b`` is a module
    imports that module; otherwise it takes the attribute ``b`` of ``a``."""
    found = []
    for node, base, alias in _package_imports(module, path, ast.parse(path.read_text(), str(path)), known):
        if base is None:
            found.append((alias.name, None, node.lineno))
        else:
            sub = f"{base}.{alias.name}"
            found.append((sub, None, node.lineno) if sub in known else (base, alias.name, node.lineno))
    return found


def _package_imports(module: str, path: Path, tree: ast.AST, known: dict):
    """Each import of a package module anywhere in ``tree``: (node, None, alias) for ``import x``, (node,
    the module it imports from, alias) for each name of ``from x import a, b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node, None, a) for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            if base in known:
                yield from ((node, base, a) for a in node.names)


def graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}."""
    known = modules()
    edges = {}
    for module, path in known.items():
        edges[module] = {}
        for target, _, line in imports(module, path, known):
            if target != module:
                edges[module].setdefault(target, line)
    return edges


def cycles(edges: dict[str, dict]) -> list[list[str]]:
    """Every strongly connected component with more than one node, each as one cycle's path through it."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_path_through(sorted(c), edges) for c in comps]


def _path_through(comp: list[str], edges: dict) -> list[str]:
    """One cycle inside a strongly connected component, from its first node back to it (breadth first)."""
    start, members = comp[0], set(comp)
    came = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in edges.get(v, ()):
            if w == start:
                path = [v]
                while came[path[-1]] is not None:
                    path.append(came[path[-1]])
                return [*reversed(path), start]
            if w in members and w not in came:
                came[w] = v
                queue.append(w)
    return comp


def _describe(path: list[str], edges: dict) -> str:
    return " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def part(module: str) -> str:
    """The part of the package a module belongs to: its subpackage, or its own name at the top."""
    rest = module.split(".")[1:]
    return rest[0] if rest else "__init__"


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert len(edges) > 60 and sum(map(len, edges.values())) > 100, "the graph reader found too little"
    found = cycles(edges)
    assert not found, "import cycles (lazy imports included):\n" + "\n".join(_describe(c, edges) for c in found)


def test_the_packages_import_no_cycle_either():
    """Folded to parts (kernel, rank, ...), the graph is still acyclic: no package leans on one that leans
    back on it, even through different modules."""
    edges, folded, where = graph(), {}, {}
    for a, targets in edges.items():
        for b, line in targets.items():
            if part(a) != part(b):
                folded.setdefault(part(a), {}).setdefault(part(b), line)
                where.setdefault((part(a), part(b)), f"{a}:{line} imports {b}")
    found = cycles(folded)
    assert not found, "package cycles:\n" + "\n".join(
        " -> ".join(p) + "\n  " + "\n  ".join(where[s] for s in zip(p, p[1:])) for p in found)


def _allowed(module: str, target: str) -> bool:
    ok = MAY_IMPORT[part(module)]
    if "*" in ok or part(target) == part(module):
        return True
    short = target.split(".", 1)[1]  # kernel.options
    return any(short == rule or short.startswith(rule + ".") for rule in ok)


def test_no_package_imports_one_above_it():
    """The layers of architecture.md's "Where code runs" table, lazy imports included: the wire at the
    bottom, then the seams and IPython helpers, then rank and views code, the kernel, and the cluster
    and export above it."""
    assert set(MAY_IMPORT) >= {part(m) for m in modules()}, "a new part of the package needs its row here"
    bad = [f"{m}:{line} imports {t}" for m, targets in graph().items() for t, line in targets.items()
           if not _allowed(m, t)]
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(sorted(bad))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.AST) -> set[str]:
    """Every name a module defines or binds: functions, classes, variables, arguments, ``self.x``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
    return names


def _own(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_uses() -> list[str]:
    """Every ``from x import _name`` and ``x._name`` (x an imported package module) across modules, and
    ``obj._name`` where ``_name`` is a private name another package module defines and this one does not
    (an object of another module's class, its privates read or written from outside; ``self`` and
    ``cls`` are a class's own, or a third-party class's)."""
    known, bad = modules(), []
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in known.items()}
    defined = {m: _defined(t) for m, t in trees.items()}
    theirs = {n for names in defined.values() for n in names if _private(n)}
    for module, path in known.items():
        tree = trees[module]
        bad += [f"{path.relative_to(ROOT)}:{node.lineno} uses {ast.unparse(node)}, private to "
                + ", ".join(m for m in known if node.attr in defined[m])
                for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in theirs
                and node.attr not in defined[module] and not _own(node.value)]
        bound = {}  # local name -> the package module it is bound to, wherever in the file
        for node, base, a in _package_imports(module, path, tree, known):
            if base is None:
                bound[a.asname or a.name.partition(".")[0]] = a.asname and a.name or a.name.partition(".")[0]
            elif f"{base}.{a.name}" in known:
                bound[a.asname or a.name] = f"{base}.{a.name}"
            elif _private(a.name) and base != module:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {base}.{a.name}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if not isinstance(inner, ast.Name) or inner.id not in bound:
                continue
            target = bound[inner.id]
            for attr in reversed(chain):  # walk down submodules (nbddp.kernel.names.sending) to the first name
                if f"{target}.{attr}" in known:
                    target = f"{target}.{attr}"
                    continue
                if _private(attr) and target != module:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {target}.{attr}")
                break
    return sorted(set(bad))


def test_no_module_uses_another_modules_private_names():
    """A leading underscore means "this module's own": another module that needs it needs a public name."""
    bad = private_uses()
    assert not bad, "private names used across modules:\n" + "\n".join(bad)
