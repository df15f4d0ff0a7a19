"""In the kernel: every scalar the ranks logged in this kernel (``nbddp.log``, the numbers of a tqdm bar's
postfix), for ``nbddp.metrics()`` and each run's ``metrics.csv``.

A ``Recorder`` is one of a cell's listeners on the supervisor's bus (kernel/cells/engine.py); it files
each ``messages.Scalars`` (and each ``Progress`` whose postfix has numbers, at the bar's step ``n``) in
the kernel's one ``STORE``, under the cell's label, and at the cell's end rewrites the run directory's
``metrics.csv`` (a pool's directory: every cell of the pool, so a curve goes on across cells).
"""
from __future__ import annotations

import csv
import math
import os
import threading

from ..views import charts
from ..wire.messages import Scalars

CSV_NAME = "metrics.csv"
COLUMNS = ("cell", "rank", "step", "time")  # then one per scalar name, in the order first logged


class Store:
    """Rows of every cell, as column chunks: (cell, run dir, rank, a ``Scalars``)."""

    def __init__(self):
        self.chunks: list[tuple] = []
        self.names: dict[str, None] = {}  # every scalar name, in the order first logged
        self.lock = threading.Lock()  # (a background cell's thread adds while the notebook reads)

    def add(self, cell: str, run_dir: str, rank: int, record: Scalars) -> None:
        with self.lock:
            self.chunks.append((cell, run_dir, rank, record))
            for name in record.values:
                self.names.setdefault(name, None)

    def rows(self, run_dir: str | None = None) -> tuple[list, list]:
        """(columns, rows): one row per logged call, ``run_dir``'s only if given."""
        with self.lock:
            chunks, names = list(self.chunks), list(self.names)
        columns = [*COLUMNS, *names]
        out = []
        for cell, where, rank, rec in chunks:
            if run_dir is not None and where != run_dir:
                continue
            values = [rec.values.get(name) for name in names]
            for i, (step, when) in enumerate(zip(rec.steps, rec.times)):
                out.append([cell, rank, step, when, *(math.nan if v is None else v[i] for v in values)])
        return columns, out

    def frame(self):
        """Everything logged in this kernel, as a pandas DataFrame (``nbddp.metrics()``)."""
        try:
            import pandas as pd
        except ImportError:
            from ..errors import NbddpError

            raise NbddpError("nbddp.metrics() gives a pandas DataFrame, and pandas is not installed here: "
                             "pip install pandas (the same rows are in each run's metrics.csv)") from None
        columns, rows = self.rows()
        return pd.DataFrame(rows, columns=columns)

    def write_csv(self, run_dir: str) -> str | None:
        columns, rows = self.rows(run_dir)
        if not rows:
            return None
        path = f"{run_dir}/{CSV_NAME}"
        keep = [i for i, c in enumerate(columns) if i < len(COLUMNS) or any(not math.isnan(r[i]) for r in rows)]
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", newline="") as f:  # private, as every file of a run
            out = csv.writer(f)
            out.writerow([columns[i] for i in keep])
            out.writerows([["" if isinstance(r[i], float) and math.isnan(r[i]) else r[i] for i in keep] for r in rows])
        return path


STORE = Store()


class Recorder:
    """A cell's listener: what its ranks log, filed in ``STORE`` under the cell's label."""

    def __init__(self, cell: str, run_dir, store: Store = STORE):
        self.cell, self.run_dir, self.store = cell, str(run_dir), store
        self.logged = False
        self.bars: dict = {}  # (rank, bar) -> the step its postfix was last taken at (charts.logged)

    def on_Message(self, event) -> None:
        rec = charts.logged(event.rank, event.record, self.bars)
        if rec is not None:
            self.store.add(self.cell, self.run_dir, event.rank, rec)
            self.logged = True

    def finish(self) -> None:
        if self.logged:
            try:
                self.store.write_csv(self.run_dir)
            except OSError:  # a run directory gone: nbddp.metrics() still has them
                pass



def cell_name() -> str:
    """The notebook cell a run belongs to, as ``nbddp.metrics()`` names it: ``In [4]`` (``launch``
    outside IPython: ``nbddp.launch`` from a script)."""
    from ..ipy import cells
    from ..ipy.session import running_shell

    shell = running_shell()
    return f"In [{cells.running(shell)}]" if shell is not None else "launch"
