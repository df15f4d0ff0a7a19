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


# who the ranks are: the supervisor's processes, a rank process's number, the process group's generation
MEMBERSHIP = {"procs", "rank", "generation"}
MEMBERSHIP_MODULE = pathlib.Path("nbddp/kernel/ranks/membership.py")


def _assigned_attributes(tree):
    """Each attribute an assignment, an augmented one or a ``setattr`` with a constant name sets: (its node, the
    object's expression, the attribute's name)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            yield node, node.args[0], node.args[1].value
            continue
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute):
                yield target, target.value, target.attr


def test_only_the_membership_changes_who_the_ranks_are():
    """One authority changes a pool's membership (kernel/ranks/membership.py's ``Membership``, torchft's ``Manager``
    the model): no other module assigns another object's ``procs`` (the supervisor's rank processes), ``rank`` (a
    rank process's number) or ``generation`` (the process group's), as ``gang.generation += 1``, ``proc.rank = n``
    or ``sup.procs = [...]`` did; an object's own methods on ``self`` may (the supervisor's ``self.procs``), and
    records built with ``rank=`` (a constructor's or ``dataclasses.replace``'s keywords) are no assignment. The rank
    side (nbddp/rank/) is left out: its ``rank`` attributes are other things (Lightning's ``rank_zero_only.rank``)."""
    found = []
    for path, _, tree in _modules():
        if path.parts[1] == "rank" or path == MEMBERSHIP_MODULE:
            continue
        for node, owner, name in _assigned_attributes(tree):
            if name in MEMBERSHIP and not (isinstance(owner, ast.Name) and owner.id == "self"):
                found.append(f"{path}:{node.lineno}: {ast.unparse(owner)}.{name}")
        found += [f"{path}:{node.lineno}: {ast.unparse(node)}" for node in _written_into_a_membership(tree)]
    assert not found, ("who the ranks are is the pool's Membership's to change (kernel/ranks/membership.py: "
                       "next_generation, forget, renumber, grow, place; move_procs):\n" + "\n".join(found))


def _written_into_a_membership(tree):
    """Each target of an assignment that writes into a ``Membership``'s tables from outside (``gang.members.nodes[r]
    = ...``, as a Ray pool's placement was written before ``Membership.place``)."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            part = target
            while isinstance(part, (ast.Attribute, ast.Subscript)):
                if isinstance(part, ast.Attribute) and part.attr == "members" and part is not target:
                    yield target
                    break
                part = part.value
