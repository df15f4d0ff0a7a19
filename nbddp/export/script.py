"""From notebook to cluster: write the %%ddp cells (and the plain cells they need) as a torchrun script.

nbddp does not grow a cluster engine. The exported script initialises the process group from the
environment torchrun sets (``--standalone`` on one machine, ``--nnodes N --rdzv-backend c10d`` or SLURM
``srun`` across machines) and runs each %%ddp body with ``rank``, ``local_rank``, ``world_size`` and
``device`` defined as in the notebook.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

from .pysyntax import TIME_HELPERS, is_help, to_python

HEADER = '''#!/usr/bin/env python
"""Exported by nbddp from {source}.

Run on one machine:   torchrun --standalone --nproc-per-node {nproc} {script}
Across machines:      torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:29500 {script}
"""
import os

import torch
import torch.distributed as dist
'''

RANDOM_STATE = '''

def _nbddp_notebook_cells_begin(seed):
    """The notebook ran its plain cells once, in the kernel: every rank saw one copy of what they built.
    Here every process runs them, so every process starts them from the same random state, and only
    rank 0 prints (the notebook showed their output once)."""
    import random
    import sys
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    if os.environ.get("RANK", "0") != "0":
        sys.stdout = open(os.devnull, "w")


def _nbddp_notebook_cells_end():
    """Back to this process's own random numbers and output, as under plain torchrun."""
    import random
    import sys
    random.seed()
    torch.seed()
    try:
        import numpy
        numpy.random.seed()
    except ImportError:
        pass
    if sys.stdout is not sys.__stdout__:
        sys.stdout.close()
        sys.stdout = sys.__stdout__


def _nbddp_show(value):
    """What the notebook showed as Out[n] (IPython's pretty form), printed once."""
    if value is None or os.environ.get("RANK", "0") != "0":
        return
    try:
        from IPython.lib.pretty import pretty
    except ImportError:
        pretty = repr
    print(pretty(value))
'''

SETUP = '''

def _nbddp_process_group():
    """What %%ddp did before running the cell: the process group and this rank's device. A notebook cell
    run above may have made the group already (accelerate's PartialState(), Lightning, its own
    init_process_group: in the kernel they made none, here torchrun's environment makes them): that group
    is used, never a second one."""
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device) if cuda else dist.init_process_group("gloo")
    return dist.get_rank(), local_rank, dist.get_world_size(), device


def _nbddp_joins(init):
    """A %%ddp cell's own init_process_group() joins the group its rank is in, as in the notebook (nbddp's
    ranks start in one): called while a group is up it does nothing; after destroy_process_group() it
    makes a new one."""
    import functools

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        if not dist.is_initialized():
            return init(*args, **kwargs)

    return init_process_group


rank, local_rank, world_size, device = _nbddp_process_group()
dist.init_process_group = _nbddp_joins(dist.init_process_group)
'''

FOOTER = '''
if dist.is_initialized():  # a cell may have destroyed the group itself, as torchrun scripts do
    dist.barrier()  # every rank is past its last collective before the group is torn down
    dist.destroy_process_group()
'''

IMPORTS = {"subprocess": "import subprocess", "io": "import contextlib\nimport io"}
SEED = 1234  # the notebook cells' shared random state; a cell that seeds itself still wins


def is_ddp(cell: str) -> bool:
    return cell.lstrip().startswith("%%ddp") and not is_help(cell)


def _skipped(cell: str) -> bool:
    """Cells the script has nothing to do for: help (``x?``, ``%%ddp?``) and the export itself."""
    return is_help(cell) or cell.lstrip().startswith(("%ddp_export", "%%ddp_export"))


def _split_magic(cell: str) -> tuple[str, str]:
    first, _, body = cell.lstrip().partition("\n")
    return first[len("%%ddp"):].strip(), body


def _names(code: str) -> tuple[set[str], set[str]]:
    """(defined, used) global names of a code block; changing a name's contents (``X[0] = 1``,
    ``model.w = w``) counts as defining it."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set(), set()
    defined, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (defined if isinstance(node.ctx, (ast.Store, ast.Del)) else used).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                defined.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                defined.add(base.id)
    return defined, used


def export_cells(cells: list[str], source: str = "a notebook", script: str = "train.py",
                 failed: dict[int, str] | None = None) -> str:
    """The script for these cells (in execution order). ``failed``: the cells (their index here) that
    failed in the session, and why: left out, with a comment where they were (a typo the user fixed in
    the next cell must not end the script)."""
    failed = {i: _left_out(i, cells[i], why) for i, why in (failed or {}).items() if i < len(cells)}
    cells = ["" if _skipped(c) or i in failed else c for i, c in enumerate(cells)]
    ddp_positions = [i for i, c in enumerate(cells) if is_ddp(c)]
    if not ddp_positions:
        raise ValueError(f"{source} has no %%ddp cell to export"
                         + (" that ran without an error" if failed else ""))
    needs: set[str] = set()
    python = {}
    for i, c in enumerate(cells[: ddp_positions[-1] + 1]):
        code, more = to_python(_split_magic(c)[1] if is_ddp(c) else c)
        python[i] = code
        needs |= more
    needed: set[str] = set()
    keep: set[int] = set(ddp_positions)
    for i in range(ddp_positions[-1], -1, -1):  # walk back: keep the plain cells the %%ddp cells need
        defined, used = _names(python[i])
        if i in keep or defined & needed:
            keep.add(i)
            needed |= used
    nproc = 2
    parts = []
    setup_done = False
    in_notebook_cells = False
    for i in sorted(keep | {i for i in failed if i < ddp_positions[-1]}):
        if i in failed:
            parts.append(failed[i])
            continue
        if not is_ddp(cells[i]):
            if not in_notebook_cells:
                parts.append(f"\n_nbddp_notebook_cells_begin({SEED + i})\n")
                in_notebook_cells = True
            parts.append(f"\n# --- notebook cell {i + 1} (runs on every process) ---\n{_with_result(python[i])}\n")
            continue
        if in_notebook_cells:
            parts.append("\n_nbddp_notebook_cells_end()\n")
            in_notebook_cells = False
        options, _ = _split_magic(cells[i])
        nproc = _devices(options) or nproc
        if not setup_done:
            parts.append(SETUP)
            setup_done = True
        parts.append(f"\n# --- %%ddp cell {i + 1} ({options or 'no options'}) ---\n{_with_result(python[i])}\n")
    helpers = "".join(f"{IMPORTS[n]}\n" for n in sorted(needs) if n in IMPORTS)
    helpers += RANDOM_STATE + (TIME_HELPERS if "time" in needs else "")
    return HEADER.format(source=source, nproc=nproc, script=script) + helpers + "".join(parts) + FOOTER


def _left_out(i: int, cell: str, why: str, shown: int = 3) -> str:
    """The comment that stands where a cell that failed in the session would be."""
    why = why.strip().splitlines()[0][:200] if why.strip() else "an error"
    lines = cell.strip("\n").splitlines()
    code = "".join(f"#     {line}\n" for line in lines[:shown]) + ("#     ...\n" if len(lines) > shown else "")
    return f"\n# --- cell {i + 1} left out: it failed in the session ({why}) ---\n{code}"


def _devices(line: str) -> int | None:
    """How many processes the cell asked for (``--devices``, however written), read by the magic's own
    parser; None for auto, -1 or a line this nbddp no longer takes."""
    from IPython.core.error import UsageError as ParseError

    from ..errors import UsageError
    from ..kernel import devices, options

    try:
        asked = devices.parse_devices(options.parse(line).get("devices", "auto"))
    except (UsageError, ParseError, ValueError):  # a line the magic refused (the cell ran nothing then)
        return None
    if isinstance(asked, list):
        return len(asked)
    return asked if isinstance(asked, int) and asked > 0 else None


def _with_result(body: str) -> str:
    """The cell's last expression is shown once, as the notebook showed it as Out[n] (nothing for None,
    nothing after a trailing ``;``). Only the expression is wrapped: a comment after it, a statement
    before it on the same line and the lines of a multi-line expression stay as they were."""
    from ..ipy.cellcode import silenced

    try:
        tree = ast.parse(body)
    except SyntaxError:
        return body.rstrip()
    if not tree.body or not isinstance(tree.body[-1], ast.Expr) or silenced(body):
        return body.rstrip()
    last = tree.body[-1]
    if isinstance(last.value, ast.Call) and getattr(last.value.func, "id", "").startswith(("print", "_nbddp_")):
        return body.rstrip()  # print(...) shows its own output; Out[n] would be None, which IPython hides
    lines = body.splitlines(keepends=True)
    start = _offset(lines, last.lineno, last.col_offset)
    end = _offset(lines, last.end_lineno, last.end_col_offset)
    return f"{body[:start]}_nbddp_show({body[start:end]}){body[end:]}".rstrip()


def _offset(lines: list[str], lineno: int, col: int) -> int:
    """Where ast's (line, UTF-8 byte column) is in the text."""
    return sum(map(len, lines[: lineno - 1])) + len(lines[lineno - 1].encode()[:col].decode())


def notebook_cells(path: str | Path) -> tuple[list[str], dict[int, str]]:
    """A saved notebook's code cells, and those that show an error (their index, the error's name)."""
    nb = json.loads(Path(path).read_text())
    cells, failed = [], {}
    for cell in (c for c in nb["cells"] if c["cell_type"] == "code"):
        for out in cell.get("outputs", ()):
            if out.get("output_type") == "error":
                failed[len(cells)] = f"{out.get('ename', 'an error')}: {out.get('evalue', '')}".rstrip(": ")
        cells.append("".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"])
    return cells, failed


def export_notebook(path: str | Path, out: str | Path) -> Path:
    out = Path(out)
    cells, failed = notebook_cells(path)
    out.write_text(export_cells(cells, source=Path(path).name, script=out.name, failed=failed))
    return out
