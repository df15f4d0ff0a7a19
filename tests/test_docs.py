"""The docs stay true to the code: reference generated from the magic, every module in architecture.md,
every message class in troubleshooting.md, README's commands run by .ci/run."""
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.mark.unit
def test_reference_is_generated_from_the_magic():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "reference.md").read_text() == gen.render(), "run: python docs/gen_reference.py"


def _modules() -> dict[str, str]:
    """Every module of the package: its short name (unique) -> its dotted name."""
    found = {}
    for path in sorted((ROOT / "nbddp").rglob("*.py")):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.stem != "__init__":
            assert path.stem not in found, f"two modules named {path.stem}: the docs could not tell them apart"
            found[path.stem] = dotted
    return found


@pytest.mark.unit
def test_architecture_names_every_module_and_subpackage():
    text = (DOCS / "architecture.md").read_text()
    paths = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "nbddp").rglob("*.py"))
    missing = [p for p in paths if p not in text and not (p.endswith("__init__.py") and p[:-11] in text)]
    assert not missing, f"docs/architecture.md does not mention {missing}"


@pytest.mark.unit
def test_architecture_names_are_the_codes_names():
    """Every `module.Name` (and `module.Name.attr`) the document writes in backticks exists in the code."""
    import importlib

    text = (DOCS / "architecture.md").read_text()
    modules = _modules()
    refs = set(re.findall(r"`([a-z_]+)\.([A-Za-z_]+)(?:\.([A-Za-z_]+))?`", text))
    refs = {r for r in refs if r[0] in modules}
    # the diagram's names too: every module.Name written there
    diagram = text[text.index("```"):text.index("```", text.index("```") + 3)]
    refs |= {(m, n, "") for m, n in re.findall(r"\b([a-z_]+)\.([A-Za-z_]+)\b", diagram) if m in modules}
    refs = {r for r in refs if r[1] != "py"}  # "magic.py": a file, not a name
    assert len(refs) >= 30, refs
    missing = []
    for mod, name, attr in sorted(refs):
        obj = importlib.import_module(modules[mod])
        for part in (name, attr):
            if part and not hasattr(obj, part):
                missing.append(".".join(p for p in (mod, name, attr) if p))
                break
            obj = getattr(obj, part) if part else obj
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"
    # every event the supervisor publishes, every record a rank sends, every command a pool's kernel sends
    from nbddp.kernel.ranks import supervisor
    from nbddp.wire import messages

    for cls in supervisor.EVENTS:
        assert cls.__name__ in text, cls
    messages_part = text[text.index("## Messages"):text.index("## Options")]
    for cls in (*messages.RANK_SENDS, *messages.KERNEL_SENDS):
        assert f"`{cls.__name__}`" in messages_part, cls


@pytest.mark.unit
def test_rank_and_view_code_import_only_the_wire_ipython_helpers_and_hardware_seams():
    """The layout says where code runs: rank and view modules (and the wire, helpers and seams) never
    import the kernel side; the wire imports nothing of nbddp but itself, errors and units."""
    import ast

    allowed = {"rank": {"rank", "wire", "ipy", "hw", "errors", "units", "timeline"},
               "views": {"views", "wire", "ipy", "hw", "errors", "units"},
               "wire": {"wire", "errors", "units"}, "ipy": {"ipy", "hw", "errors", "units"},
               "hw": {"hw", "errors", "units", "timeline"}}
    bad = []
    for side, ok in allowed.items():
        for path in (ROOT / "nbddp" / side).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("nbddp")):
                    parts = (node.module or "").split(".")
                    if node.level == 1:
                        target = side
                    elif node.level == 2:
                        target = parts[0] if node.module else None
                    else:
                        target = parts[1] if len(parts) > 1 else None
                    names = [a.name for a in node.names] if target is None else [target]
                    bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n not in ok]
    assert not bad, bad


MESSAGES = [  # a fragment of every message a user can meet (see the modules raising them)
    "unrecognized arguments", "is not a device spec", "more than once", "need at least one device",
    "cannot be negative", "names no device", "CPU ranks are counted, not indexed", "but this machine has",
    "NVML sees no GPU", "has no CUDA support", "--backend nccl needs GPUs", "need a whole number >= 1",
    "need a number of seconds > 0", "does not compile", "fork is not available", "has neither fork nor posix_spawn",
            "cannot be pickled",
    "cannot launch from inside a rank", "another nbddp launch is still running",
            "CUDA was initialised in this kernel by",
    "already initialised in this kernel", "also failed (likely a consequence)", "failed the same way",
            "stopped by nbddp after rank",
    "killed by SIGKILL", "killed by SIGSEGV", "killed by SIGBUS", "killed by SIGABRT", "exited with code",
    "called sys.exit", "exited (code 0)", "'s return value", "--timeout", "was here:", "KeyboardInterrupt",
    "never defined", "Out[] stays empty", "failed while joining the process group", "left early",
    "could not leave the process group", "send model.module.state_dict()", "holds only this rank's shards",
    "an open file", "send list(...)", "(--max-value-mb)", "unknown option", "bad options `",
    "a quotation mark is not closed", "it ends with a backslash",
    "The pool and its state survived", "The pool was torn down", "The pool has ended",
    "which the running pool cannot change", "a pool is already running", "the pool is not running",
    "changed in the notebook since %ddp start", "a pool forks its ranks", "the pool and its state survived",
    "initialize the default process group twice", "it cannot make a different one",
    "new process(es) from each rank", "would start a whole torchrun job", "directly",
    "cannot release its worker threads", "CPU ranks on", "they take turns on the cores",
    "interrupted while rank(s)", "nbddp stopped every rank", "was at Cell In[", "did not stop its cell",
    "not in the cell's code", "every thread's whole stack is in", "SyntaxError: ", "waiting in an `await`",
    "more output than --max-lines", "more output than --max-output-mb", "line cut at", "need a size in MiB >= 0",
    "need a size in MiB > 0", "need a whole number >= 0", "choose all, 0, none", "the pool has ended:",
    "the pool had already ended", "--out and --gather bring values back from it",
    "finished the cell without joining it", "its process group was made anew",
    "does not run this cell (--ranks)", "--ranks runs a cell on some ranks of a running pool",
            "the pool has rank(s) 0-",
    "kept no failure", "no cell of this pool has failed on a rank", "looks into a running pool's ranks",
    "has no command pipe, so it cannot reach the notebook's input box", "post-mortem (%pdb is on)", "is still at",
    "the cell is empty", "the cell never assigns it", "the cell assigns it, but not on rank", "holds a DTensor at",
]


@pytest.mark.unit
def test_troubleshooting_covers_every_message():
    text = (DOCS / "troubleshooting.md").read_text()
    missing = [m for m in MESSAGES if m not in text]
    assert not missing, f"docs/troubleshooting.md lacks {missing}"


def test_ci_runs_the_readme_commands_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert readme.index("```bash") < readme.index("##"), "README.md must open with its two commands"
    assert "nbddp demo" in blocks[0] and "pytest" in blocks[1]
    listed = subprocess.run(["bash", "-c", "awk '/^```bash$/{inside=1; next} /^```$/{inside=0} inside' README.md"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert listed[:2] == [blocks[0], blocks[1]]
    assert "readme_commands" in (ROOT / ".ci" / "run").read_text()


GPU_MESSAGES = [  # the guard's and free-GPU picking's messages (nbddp/cuda.py, nbddp/devices.py)
    "(module gpulib)", "(inside module", "(the cell's own code)", "was initialised before %load_ext nbddp",
    "found no free GPU", "free GPUs, but", "skipped:", "is busy:", "using it as asked", "is in MIG mode",
]


@pytest.mark.unit
def test_troubleshooting_covers_the_gpu_messages():
    text = (DOCS / "troubleshooting.md").read_text()
    missing = [m for m in GPU_MESSAGES if m not in text]
    assert not missing, f"docs/troubleshooting.md lacks {missing}"


def _kinds_handled(path: Path) -> set[str]:
    """The message kinds (wire/messages.py's records) a module tells apart: in ``isinstance(x, ...)`` or
    ``type(x) is ...``, which is where a module handles a kind rather than passing records along."""
    import ast

    from nbddp.wire import messages

    kinds = {c.__name__ for c in (*messages.RANK_SENDS, *messages.KERNEL_SENDS)}

    tree = ast.parse(path.read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").endswith("messages") for a in node.names}

    def names(node):  # messages.Kind, or a Kind imported from wire/messages.py (not ast.Call and the like)
        return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node)
                if (isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "messages")
                or (isinstance(n, ast.Name) and n.id in imported)}

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2:
            found |= names(node.args[1]) & kinds
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            found |= names(node) & kinds
    return found


@pytest.mark.unit
def test_each_module_row_names_the_message_kinds_the_module_handles():
    """A module that tells a message kind apart names it in its architecture.md row, so the map of who
    handles what cannot drift from the code."""
    text = (DOCS / "architecture.md").read_text()
    rows = {}
    for line in text.splitlines():
        for path in re.findall(r"^\| `(nbddp/[a-z_/]+\.py)`", line):
            rows[path] = line
    assert len(rows) >= 40, "the module table was not found"
    missing = []
    for path, row in sorted(rows.items()):
        for kind in sorted(_kinds_handled(ROOT / path)):
            if not re.search(rf"\b{kind}\b", row):
                missing.append(f"{path}: {kind}")
    assert not missing, f"docs/architecture.md's module rows do not name the message kinds they handle: {missing}"


def _class_names() -> dict:
    """Every class of the package by name -> the names it has: what its body defines and what its methods
    assign on ``self`` (instance attributes), read with ``ast`` (nothing imported)."""
    import ast

    found: dict = {}
    for path in (ROOT / "nbddp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = found.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                    names.add(item.id)
                elif (isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
                      and isinstance(item.value, ast.Name) and item.value.id == "self"):
                    names.add(item.attr)
    return found


@pytest.mark.unit
def test_architecture_names_only_methods_and_attributes_the_classes_have():
    """Every `Class.name` the document writes in backticks is a class of the package with that method or
    attribute (it named `Pool.mend` and `Pool.resize` long after they had moved)."""
    text = (DOCS / "architecture.md").read_text()
    refs = set(re.findall(r"`([A-Z][A-Za-z_]+)\.([A-Za-z_]+)`", text))
    classes = _class_names()
    missing = sorted(f"{c}.{a}" for c, a in refs if a not in classes.get(c, ()))
    assert len(refs) >= 50 and not missing, f"docs/architecture.md names what the classes do not have: {missing}"
