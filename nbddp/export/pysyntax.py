"""IPython syntax → plain Python, for scripts that run without a kernel (``nbddp export``).

IPython first turns a cell into Python that calls ``get_ipython()`` (``!ls`` →
``get_ipython().system('ls')``); each such call is then replaced by what it does, in plain Python:

| notebook | script |
|---|---|
| ``!cmd``, ``x = !cmd`` | ``subprocess.run(cmd, shell=True)``, its stdout lines |
| ``%time stmt``, ``%%time`` | the code, and the same "CPU times / Wall time" lines |
| ``%timeit stmt``, ``%%timeit`` | the code, run once (time it in the notebook) |
| ``%%capture`` | the body with its output swallowed, as in the notebook |
| ``%env A=1``, ``%cd dir`` | ``os.environ["A"] = "1"``, ``os.chdir(...)`` |
| ``%%writefile f``, ``%%bash`` | writes the file, runs bash |
| ``x?``, ``%pip``, ``%matplotlib``, ``%load_ext``, others | a comment: notebook only |
"""
from __future__ import annotations

import ast
import itertools
import re

_timers = itertools.count()

HELP = {"pinfo", "pinfo2", "pdoc", "pdef", "psource", "pfile"}
TIME_HELPERS = '''

def _nbddp_clock():
    """%time: CPU and wall clocks now."""
    import time
    t = os.times()
    return t.user, t.system, time.perf_counter()


def _nbddp_timed(start):
    """%time's report, in IPython's words."""
    import time
    t = os.times()
    user, sys_, wall = t.user - start[0], t.system - start[1], time.perf_counter() - start[2]

    def fmt(s):
        for scale, unit in ((1, "s"), (1e3, "ms"), (1e6, "\\u03bcs"), (1e9, "ns")):
            if s * scale >= 1 or unit == "ns":
                return f"{s * scale:.3g} {unit}"

    print(f"CPU times: user {fmt(user)}, sys: {fmt(sys_)}, total: {fmt(user + sys_)}")
    print(f"Wall time: {fmt(wall)}")
'''


def is_help(cell: str) -> bool:
    """A cell that only asks for help (``x?``, ``%%ddp?``): the script has nothing to run for it."""
    stripped = cell.strip()
    return bool(stripped) and "\n" not in stripped and (stripped.endswith("?") or stripped.startswith("?"))


def to_python(cell: str) -> tuple[str, set[str]]:
    """The cell as plain Python, and the helpers it needs (``"subprocess"``, ``"time"``, ``"io"``)."""
    from IPython.core.inputtransformer2 import TransformerManager

    src = TransformerManager().transform_cell(cell)
    if "get_ipython()" not in src:
        return cell.rstrip(), set()
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return cell.rstrip(), set()
    needs: set[str] = set()
    lines = src.splitlines()
    edits = []  # (first line, last line, replacement lines), 1-based, inclusive
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or hasattr(stmt, "body"):
            continue  # compound statements: their own simple statements are visited
        call = _magic_call(stmt.value) if isinstance(stmt, ast.Expr) else None
        if call is not None:
            code = _statement(call, needs)
        elif any(_magic_call(n) for n in ast.walk(stmt)):
            code = ast.unparse(_Expressions(needs).visit(stmt))
        else:
            continue
        pad = " " * stmt.col_offset
        edits.append((stmt.lineno, stmt.end_lineno, [pad + line if line else line for line in code.splitlines()]))
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1:last] = new
    return "\n".join(lines).rstrip(), needs


def _magic_call(node):
    """(kind, args) for ``get_ipython().kind(*constant args)``, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "get_ipython"
            and all(isinstance(a, ast.Constant) for a in node.args)):
        return node.func.attr, [a.value for a in node.args]
    return None


def _shell_string(cmd: str) -> str:
    """IPython expands ``{expr}`` and ``$name`` in shell commands: so does the f-string."""
    if "{" not in cmd and "$" not in cmd:
        return repr(cmd)
    cmd = re.sub(r"(?<!\$)\$([A-Za-z_]\w*)", r"{\1}", cmd).replace("$$", "$")
    return "f" + repr(cmd)


def _statement(call, needs: set[str]) -> str:
    kind, args = call
    if kind == "system":
        needs.add("subprocess")
        return f"subprocess.run({_shell_string(args[0])}, shell=True)  # !{args[0]}"
    if kind == "run_line_magic":
        return _line_magic(args[0], args[1], needs)
    if kind == "run_cell_magic":
        return _cell_magic(args[0], args[1], args[2], needs)
    return _notebook_only(f"{kind}{tuple(args)}")


def _line_magic(name: str, line: str, needs: set[str]) -> str:
    if name in HELP:
        return _notebook_only(f"{line}?  (help)")
    if name == "time":
        return _timed(to_python(line)[0], "%time", needs)
    if name == "timeit":
        return f"{to_python(line)[0]}  # %timeit: run once here; time it in the notebook"
    if name == "env":
        m = re.match(r"\s*([A-Za-z_]\w*)\s*[= ]\s*(.*)$", line)
        if m:
            return f"os.environ[{m.group(1)!r}] = {m.group(2).strip()!r}  # %env {line}"
    if name == "cd":
        return f"os.chdir(os.path.expanduser({line.strip()!r}))  # %cd {line}"
    return _notebook_only(f"%{name} {line}".rstrip())


def _timed(code: str, magic: str, needs: set[str]) -> str:
    """``%time`` / ``%%time`` in a script: the code between a clock reading and a printed duration."""
    needs.add("time")
    t = f"_nbddp_t{next(_timers)}"
    return f"{t} = _nbddp_clock()  # {magic}\n{code}\n_nbddp_timed({t})"


def _cell_magic(name: str, line: str, body: str, needs: set[str]) -> str:
    code, more = to_python(body)
    needs |= more
    if name == "time":
        return _timed(code, "%%time", needs)
    if name == "timeit":
        return f"# %%timeit {line}: run once here; time it in the notebook\n{code}"
    if name == "capture":
        needs.add("io")
        indented = "\n".join("    " + ln if ln else ln for ln in code.splitlines()) or "    pass"
        return ("# %%capture: the notebook showed none of this output\n"
                "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
                f"{indented}")
    if name == "writefile":
        path = line.split()[-1] if line.split() else "a.txt"
        mode = "a" if line.split()[:1] in (["-a"], ["--append"]) else "w"
        return f"with open({path!r}, {mode!r}) as _nbddp_f:  # %%writefile {line}\n    _nbddp_f.write({body!r})"
    if name in ("bash", "sh"):
        needs.add("subprocess")
        return f"subprocess.run([{name!r}, '-c', {body!r}])  # %%{name}"
    return "\n".join(["# (notebook only) %%" + f"{name} {line}".rstrip()] + [f"# {ln}" for ln in body.splitlines()])


def _notebook_only(what: str) -> str:
    return f"pass  # (notebook only) {what}"


class _Expressions(ast.NodeTransformer):
    """``x = !ls``, ``y = %time f()``: the magic inside an expression becomes an expression."""

    def __init__(self, needs: set[str]):
        self.needs = needs

    def visit_Call(self, node):
        self.generic_visit(node)
        call = _magic_call(node)
        if call is None:
            return node
        kind, args = call
        if kind == "getoutput":
            self.needs.add("subprocess")
            code = (f"subprocess.run({_shell_string(args[0])}, shell=True, capture_output=True, "
                    "text=True).stdout.splitlines()")
        elif kind == "system":
            self.needs.add("subprocess")
            code = f"subprocess.run({_shell_string(args[0])}, shell=True)"
        elif kind == "run_line_magic" and args[0] in ("time", "timeit"):
            code = f"({args[1]})"  # the value; the timing itself is notebook only
        elif kind == "run_line_magic" and args[0] == "env" and "=" not in args[1] and args[1].strip():
            code = f"os.environ.get({args[1].strip()!r})"
        else:
            code = "None"
        return ast.parse(code, mode="eval").body
