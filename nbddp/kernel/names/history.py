"""The session's cells for ``%ddp_export``: each notebook cell once, as it last ran without an error.

A cell is known by the id its front end sends with each execute_request (``metadata.cellId``: JupyterLab
and Notebook 7 send the cell's id, VS Code the cell's URI), otherwise by its text. A cell run again
replaces its earlier run in place (edited or not); a run that failed leaves the cell's last good run in
the script. JupyterLab also sends ``deletedCells``, the ids of the cells deleted since its last request:
their runs drop out (a cell brought back and run again is back). Without ids, a cell run again unchanged
is the same cell, and an edited one a new cell.

The order is the order in which the cells first ran: the kernel never sees the notebook's layout, so a
cell inserted above another and run after it comes after it. ``History.export`` also says which runs it
left out and why (failed, superseded by a later run of the same cell, deleted), for the script's header.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Run:
    source: str
    number: int | None = None  # In[n], known once it ran
    error: str | None = None  # why it failed (None: it ran, or is running now)
    done: bool = False


@dataclass
class Cell:
    cell_id: str | None
    runs: list[Run] = field(default_factory=list)
    deleted: bool = False

    @property
    def text(self) -> str:
        return self.runs[-1].source.strip()


@dataclass
class Exported:
    """What ``%ddp_export`` hands the script writer: the cells in order, those whose every run failed
    (their index: why, the last run's text in ``cells``), and the runs left out as (cell index or None
    for a deleted cell, what happened), for the header."""
    cells: list[str]
    failed: dict[int, str]
    left_out: list[tuple[int | None, str]]


def request_metadata(shell, info=None) -> dict:
    """The running cell's execute_request metadata: IPython's ``ExecutionInfo.cell_meta`` (IPython 8.29+
    with ipykernel 7), else the request ipykernel is answering (``kernel.get_parent``, ipykernel 6+;
    the shell's ``parent_header`` before that); empty outside a kernel."""
    meta = getattr(info, "cell_meta", None)
    if isinstance(meta, dict):
        return meta
    return _parent(shell).get("metadata") or {}


def _parent(shell) -> dict:
    kernel = getattr(shell, "kernel", None)
    parent = None
    try:
        parent = kernel.get_parent("shell") if kernel is not None else None
    except (AttributeError, TypeError):  # an ipykernel without get_parent (or with no channel): the shell's copy below
        pass
    if not isinstance(parent, dict) or not parent:
        parent = getattr(shell, "parent_header", None)
    return parent if isinstance(parent, dict) else {}


class History:
    def __init__(self):
        self.cells: list[Cell] = []  # in the order they first ran
        self._by_id: dict[str, Cell] = {}
        self._running: Run | None = None

    def loaded(self, shell) -> None:
        """Called at ``%load_ext``: the cells IPython's history holds from before (by text; whether they
        failed is not known) and the running cell itself (its pre_run_cell came before nbddp's hook)."""
        parent = _parent(shell)
        raw = list(getattr(getattr(shell, "history_manager", None), "input_hist_raw", []))[1:]
        code = (parent.get("content") or {}).get("code")
        if code is None and raw:
            code = raw[-1]
        if raw and code is not None and raw[-1].strip() == code.strip():
            raw = raw[:-1]  # the running cell, stored before it ran
        for number, source in enumerate(raw, 1):
            if source.strip():
                self.started(source)
                self.ended(source, number, None)
        if code is not None:
            meta = parent.get("metadata") or {}
            self.started(code, meta.get("cellId"), meta.get("deletedCells") or ())

    def started(self, source: str, cell_id=None, deleted=()) -> None:
        """A cell begins to run (IPython's pre_run_cell)."""
        for gone in deleted or ():
            if str(gone) in self._by_id:
                self._by_id[str(gone)].deleted = True
        cell = self._find(source, None if cell_id is None else str(cell_id))
        cell.deleted = False
        self._running = Run(source)
        cell.runs.append(self._running)

    def ended(self, source: str | None, number: int | None, error: str | None) -> None:
        """The cell ``started`` last has run (post_run_cell; ``source`` None where IPython does not say
        which cell). A cell IPython refused before running it (its input transformation failed) never
        started, and is not this one."""
        run = self._running
        if run is None or run.done or (source is not None and run.source.strip() != source.strip()):
            return
        run.number, run.error, run.done = number, error, True
        self._running = None

    def failed_later(self, number: int, error: str) -> None:
        """Cell ``number`` ran without an error but its work failed after (a ``%%ddp --bg`` cell): as failed."""
        for cell in self.cells:
            for run in cell.runs:
                if run.number == number and run.error is None:
                    run.error = error
                    return

    def _find(self, source: str, cell_id: str | None) -> Cell:
        if cell_id is not None and cell_id in self._by_id:
            return self._by_id[cell_id]
        text = source.strip()
        for cell in reversed(self.cells):
            # a cell first seen without an id (run before %load_ext, or by a front end that sends none)
            # and now run unchanged with one is that cell; a run without an id is the cell of its text
            if cell.text == text and (cell_id is None or cell.cell_id is None):
                if cell_id is not None:
                    cell.cell_id = cell_id
                    self._by_id[cell_id] = cell
                return cell
        cell = Cell(cell_id)
        self.cells.append(cell)
        if cell_id is not None:
            self._by_id[cell_id] = cell
        return cell

    def export(self) -> Exported:
        cells: list[str] = []
        failed: dict[int, str] = {}
        left_out: list[tuple[int | None, str]] = []
        for cell in self.cells:
            if cell.deleted:
                left_out.append((None, f"{_runs(cell.runs)}: the cell was deleted in the notebook"))
                continue
            index = len(cells)
            good = [r for r in cell.runs if r.error is None]
            kept = good[-1] if good else cell.runs[-1]
            cells.append(kept.source)
            if not good:
                failed[index] = kept.error or "an error"
            superseded = [r for r in good if r is not kept]
            if superseded:
                left_out.append((index, f"{_runs(superseded)}: superseded by {_runs([kept])} of the same cell "
                                        f"(cell {index + 1} below)"))
            for run in cell.runs:
                if run.error is not None:
                    where = (f"cell {index + 1} below is its {_runs([kept])}" if good
                             else f"cell {index + 1} below, a comment")
                    left_out.append((index, f"{_runs([run])}: failed ({_first_line(run.error)}); {where}"))
        return Exported(cells, failed, left_out)


def _runs(runs: list[Run]) -> str:
    """``In [4]``, ``In [4]-[9]`` (consecutive), ``In [4], [6], [7]``; a run without a number as ``?``."""
    numbers = [r.number for r in runs]
    if len(numbers) > 2 and None not in numbers and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"In [{numbers[0]}]-[{numbers[-1]}]"
    return "In " + ", ".join(f"[{'?' if n is None else n}]" for n in numbers)


def _first_line(why: str, limit: int = 120) -> str:
    line = why.strip().splitlines()[0] if why.strip() else "an error"
    return line if len(line) <= limit else line[: limit - 1] + "…"
