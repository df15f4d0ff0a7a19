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

GROUPS = '''

_nbddp_groups = {"store": None, "rank": 0, "world_size": 1, "made": 0, "kept": []}


def _nbddp_group_calls():
    """The cells' own process-group calls behave as they did in the notebook, where every %%ddp cell ran
    in a group nbddp made (installed before any cell, so a library's calls go through them too):
    - init_process_group() while a group is up joins it: it does nothing;
    - destroy_process_group() is real (what follows sees no group); the group's object is kept until the
      script's end (as nbddp's ranks keep it until they are idle): freed while its worker thread still
      drops a finished collective, gloo's teardown can deadlock;
    - an init after a destroy makes a new group with the same ranks, on the first group's store under a key
      prefix of its own: torch names a re-made group as it named the first one, whose keys are still in
      torchrun's store, and a plain second init would wait forever for peers at the old addresses."""
    import functools
    import inspect

    from torch.distributed import distributed_c10d as c10d

    init, destroy, groups = c10d.init_process_group, c10d.destroy_process_group, _nbddp_groups

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        if dist.is_initialized():
            return None
        call = inspect.signature(init).bind(*args, **kwargs)
        if groups["store"] is not None and call.arguments.get("store") is None:
            call.arguments.update(init_method=None, rank=groups["rank"], world_size=groups["world_size"],
                                  store=dist.PrefixStore(f"nbddp-group-{groups['made']}", groups["store"]))
        init(*call.args, **call.kwargs)
        groups["made"] += 1
        if groups["store"] is None:
            groups.update(store=c10d._get_default_store(), rank=dist.get_rank(), world_size=dist.get_world_size())

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            groups["kept"].extend(getattr(c10d._world, "pg_map", ()))
        else:
            groups["kept"].append(group)
        return destroy(group)

    dist.init_process_group = c10d.init_process_group = init_process_group
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


def _nbddp_process_group():
    """What %%ddp did before running the cell: the process group and this rank's device. A cell above may
    have made the group already (accelerate's PartialState(), Lightning, its own init_process_group: in
    the kernel they made none, here torchrun's environment makes them): that group is used, never a second
    one; a cell above that destroyed it leaves this cell a new one, as each %%ddp cell had one."""
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device) if cuda else dist.init_process_group("gloo")
    return dist.get_rank(), local_rank, dist.get_world_size(), device


_nbddp_group_calls()
'''

SETUP = "rank, local_rank, world_size, device = _nbddp_process_group()\n"

FOOTER = '''
if dist.is_initialized():  # a cell may have destroyed the group itself, as torchrun scripts do
    dist.barrier()  # every rank is past its last collective before the group is torn down
    dist.destroy_process_group()
if _nbddp_groups["kept"]:  # the destroyed groups go now, not as the interpreter exits (gloo can abort there)
    import time
    time.sleep(0.1)  # the GIL free a moment: a group's worker still dropping a finished collective finishes
    _nbddp_groups["kept"].clear()
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
                 failed: dict[int, str] | None = None,
                 left_out: list[tuple[int | None, str]] | None = None) -> str:
    """The script for these cells (in the notebook's order). ``failed``: the cells (their index here) that
    failed in the session, and why: left out, with a comment where they were (a typo the user fixed in
    the next cell must not end the script). ``left_out``, for a session's cells (each cell once, in the
    order the cells first ran: kernel/names/history.py): the runs not in the script, as (the index of their
    cell here, or None for a deleted cell; what happened), said in the header for the cells it keeps."""
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
        parts.append(f"\n# --- %%ddp cell {i + 1} ({options or 'no options'}) ---\n{SETUP}{_with_result(python[i])}\n")
    helpers = "".join(f"{IMPORTS[n]}\n" for n in sorted(needs) if n in IMPORTS)
    helpers += RANDOM_STATE + GROUPS + (TIME_HELPERS if "time" in needs else "")
    header = HEADER.format(source=source, nproc=nproc, script=script)
    if left_out is not None:
        header += _session_note(left_out, shown=keep | set(failed))
    return header + helpers + "".join(parts) + FOOTER


def _session_note(left_out: list[tuple[int | None, str]], shown: set[int]) -> str:
    """The header's word on a session's cells: which run of each cell is here, in which order, and the
    runs left out (of the cells the script holds, and deleted cells)."""
    note = ("\n# Each notebook cell once, as it last ran without an error, in the order the cells first ran in\n"
            "# the session (the kernel never sees the notebook's layout: a cell inserted above another and run\n"
            "# after it comes after it). Cells are known by the id the notebook sends, else by their text.\n")
    lines = [what for i, what in left_out if i is None or i in shown]
    if lines:
        note += "# Runs of the session left out:\n" + "".join(f"#   {' '.join(what.split())}\n" for what in lines)
    return note


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
