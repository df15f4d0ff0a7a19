"""Rules of the package's code that no linter holds, read from its source (ast, no import): few broad excepts, each
saying why; one module per class name."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

# the broad excepts (bare, Exception, BaseException) nbddp may have: lower it as excepts go, never raise it
BROAD_EXCEPTS_MAX = 60
BROAD = {"Exception", "BaseException"}
REASON = re.compile(r"#\s*noqa:\s*BLE001\s+-\s+\S")  # the comment a swallowing handler carries


def _modules():
    for path in sorted((ROOT / "nbddp").rglob("*.py")):
        source = path.read_text()
        yield path.relative_to(ROOT), source, ast.parse(source, str(path))


def _broad(handler: ast.ExceptHandler) -> bool:
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(t is None or isinstance(t, ast.Name) and t.id in BROAD for t in caught)


def _logs_it(handler: ast.ExceptHandler) -> bool:
    """``logger.exception(...)`` in the handler: ruff's BLE001 lets it be (and RUF100 then refuses the noqa)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "exception"
               for n in ast.walk(handler))


def test_at_most_60_broad_excepts_each_with_its_reason():
    """A handler that ends by raising (cleanup, then ``raise``) passes the failure on; every other one says why it
    may swallow anything on its ``except`` line: ``# noqa: BLE001 - <reason>`` (a plain comment where it logs the
    exception with ``.exception()``, which ruff accepts)."""
    found, unsaid = [], []
    for path, source, tree in _modules():
        lines = source.splitlines()
        broad = [n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and _broad(n)]
        for handler in sorted(broad, key=lambda n: n.lineno):
            line = lines[handler.lineno - 1]
            found.append(f"{path}:{handler.lineno}: {line.strip()}")
            if isinstance(handler.body[-1], ast.Raise):
                continue
            said = re.search(r"#\s*\S", line) if _logs_it(handler) else REASON.search(line)
            if not said:
                unsaid.append(found[-1])
    listed = "\n".join(found)
    assert len(found) <= BROAD_EXCEPTS_MAX, (
        f"{len(found)} broad excepts, at most {BROAD_EXCEPTS_MAX}: catch what can occur there instead\n{listed}")
    assert not unsaid, "a broad except that swallows says why (# noqa: BLE001 - <reason>):\n" + "\n".join(unsaid)


def test_each_class_name_is_defined_once_in_the_package():
    """Two modules' classes of one name read as one in a traceback, a log or a review (it happened: ``Store``,
    then ``Watch`` and ``Forked``)."""
    where: dict[str, list[str]] = {}
    for path, _, tree in _modules():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{path}:{node.lineno}")
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert len(where) > 50 and not twice, twice
