"""From notebook to cluster: write the %%ddp cells (and the plain cells they need) as a torchrun script.

nbddp does not grow a cluster engine. The exported script initialises the process group from the
environment torchrun sets (``--standalone`` on one machine, ``--nnodes N --rdzv-backend c10d`` or SLURM
``srun`` across machines) and runs each %%ddp body with ``rank``, ``local_rank``, ``world_size`` and
``device`` defined as in the notebook.
"""
from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path

HEADER = '''#!/usr/bin/env python
"""Exported by nbddp from {source}.

Run on one machine:   torchrun --standalone --nproc-per-node {nproc} {script}
Across machines:      torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:29500 {script}
"""
import os

import torch
import torch.distributed as dist
'''

SETUP = '''

def _nbddp_process_group():
    """What %%ddp did before running the cell: the process group and this rank's device."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), local_rank, dist.get_world_size(), device


rank, local_rank, world_size, device = _nbddp_process_group()
'''

FOOTER = '''
dist.barrier()  # every rank is past its last collective before the group is torn down
dist.destroy_process_group()
'''


def is_ddp(cell: str) -> bool:
    return cell.lstrip().startswith("%%ddp")


def _split_magic(cell: str) -> tuple[str, str]:
    first, _, body = cell.lstrip().partition("\n")
    return first[len("%%ddp"):].strip(), body


def _plain_python(cell: str) -> str:
    """Comment out IPython-only lines (%magics, !shell) of a plain cell."""
    lines = []
    for line in cell.splitlines():
        stripped = line.lstrip()
        lines.append(f"# (notebook only) {line}" if stripped.startswith(("%", "!")) else line)
    return "\n".join(lines)


def _names(code: str) -> tuple[set[str], set[str]]:
    """(defined, used) global names of a code block."""
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
    return defined, used


def export_cells(cells: list[str], source: str = "a notebook", script: str = "train.py") -> str:
    """The script for these cells (in execution order)."""
    ddp_positions = [i for i, c in enumerate(cells) if is_ddp(c)]
    if not ddp_positions:
        raise ValueError(f"{source} has no %%ddp cell to export")
    needed: set[str] = set()
    keep: set[int] = set(ddp_positions)
    for i in range(ddp_positions[-1], -1, -1):  # walk back: keep the plain cells the %%ddp cells need
        code = _split_magic(cells[i])[1] if is_ddp(cells[i]) else _plain_python(cells[i])
        defined, used = _names(code)
        if i in keep or defined & needed:
            keep.add(i)
            needed |= used
    nproc = 2
    parts = []
    setup_done = False
    for i in sorted(keep):
        if not is_ddp(cells[i]):
            parts.append(f"\n# --- notebook cell {i + 1} (runs on every rank) ---\n{_plain_python(cells[i]).rstrip()}\n")
            continue
        options, body = _split_magic(cells[i])
        nproc = _devices(options) or nproc
        if not setup_done:
            parts.append(SETUP)
            setup_done = True
        parts.append(f"\n# --- %%ddp cell {i + 1} ({options or 'no options'}) ---\n{_with_result(body)}\n")
    return HEADER.format(source=source, nproc=nproc, script=script) + "".join(parts) + FOOTER


def _devices(options: str) -> int | None:
    args = shlex.split(options)
    for flag in ("--devices", "-d"):
        if flag in args and args.index(flag) + 1 < len(args):
            value = args[args.index(flag) + 1]
            if value.isdigit():
                return int(value)
            if "," in value:
                return len([v for v in value.split(",") if v.strip()])
    return None


def _with_result(body: str) -> str:
    """The cell's last expression is printed by rank 0, as the notebook shows it as Out[n]."""
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return body
    if not tree.body or not isinstance(tree.body[-1], ast.Expr) or body.rstrip().endswith(";"):
        return body.rstrip()
    last = tree.body[-1]
    lines = body.splitlines()
    head = "\n".join(lines[: last.lineno - 1])
    expr = "\n".join(lines[last.lineno - 1: last.end_lineno])
    return f"{head}\n_out = {expr.strip()}\nif rank == 0:\n    print(repr(_out))".lstrip("\n")


def notebook_cells(path: str | Path) -> list[str]:
    nb = json.loads(Path(path).read_text())
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "code"]


def export_notebook(path: str | Path, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(export_cells(notebook_cells(path), source=Path(path).name, script=out.name))
    return out
