"""In the kernel: every scalar the ranks logged in this kernel (``nbddp.log``, the numbers of a tqdm bar's
postfix), for ``nbddp.metrics()`` and each run's ``metrics.csv``.

A ``Recorder`` is one of a cell's listeners on the supervisor's bus (kernel/cells/engine.py); it files
each ``messages.Scalars`` (and each ``Progress`` whose postfix has numbers, at the bar's step ``n``) in
the kernel's one ``LOGBOOK``, under the cell's label, and at the cell's end rewrites the run directory's
``metrics.csv`` (a pool's directory: every cell of the pool, so a curve goes on across cells).
"""
from __future__ import annotations

import csv
import math
import os
import threading
import time
from array import array

from ..views import metrics_chart
from ..wire.messages import Scalars

CSV_NAME = "metrics.csv"
COLUMNS = ("cell", "rank", "step", "time")  # then one per scalar name, in the order first logged


class Logbook:
    """Rows of every cell, as column chunks: (cell, run dir, rank, a ``Scalars``)."""

    def __init__(self):
        self.chunks: list[tuple] = []
        self.names: dict[str, None] = {}  # every scalar name, in the order first logged
        self.lock = threading.Lock()  # (a background cell's thread adds while the notebook reads)
        self.written: dict[str, tuple] = {}  # run dir -> (its metrics.csv's header, the chunks written so far)

    def add(self, cell: str, run_dir: str, rank: int, record: Scalars) -> None:
        """A rank's batch, kept as arrays (8 bytes a value); a scalar named as a column of its own (``step``: a
        bar's postfix ``step=...``) is kept as ``step_``."""
        steps = record.steps
        kept = Scalars(array("q" if all(type(x) is int for x in steps) else "d", steps), array("d", record.times),
                       {(f"{name}_" if name in COLUMNS else name): array("d", column)
                        for name, column in record.values.items()})
        with self.lock:
            self.chunks.append((cell, run_dir, rank, kept))
            for name in kept.values:
                self.names.setdefault(name, None)

    def columns(self, run_dir: str | None = None, since: int = 0, upto: int | None = None) -> dict[str, list]:
        """Column name -> values, one per logged call (``COLUMNS``, then every name: NaN where a call did not log
        it), ``run_dir``'s only if given, of chunks ``since`` to ``upto``. Built a chunk's column at a time
        (list extends, no loop per row: a training's millions of rows in a fraction of a second)."""
        with self.lock:
            chunks, names = self.chunks[since:upto], list(self.names)
        out: dict[str, list] = {c: [] for c in (*COLUMNS, *names)}
        for cell, where, rank, rec in chunks:
            if run_dir is not None and where != run_dir:
                continue
            n = len(rec.steps)
            out["cell"] += [cell] * n
            out["rank"] += [rank] * n
            out["step"] += rec.steps
            out["time"] += rec.times
            for name in names:
                out[name] += rec.values.get(name) or [math.nan] * n
        return out

    def cell_records(self, run_dir: str, cell: str) -> list[tuple[int, Scalars]]:
        """(rank, its batch) of what ``cell`` logged in ``run_dir``, in order (a taken pool's running cell: its chart
        drawn from its first step)."""
        with self.lock:
            return [(rank, rec) for name, where, rank, rec in self.chunks if name == cell and where == run_dir]

    def frame(self):
        """Everything logged in this kernel, as a pandas DataFrame (``nbddp.metrics()``)."""
        try:
            import pandas as pd
        except ImportError:
            from ..errors import NbddpError

            raise NbddpError("nbddp.metrics() gives a pandas DataFrame, and pandas is not installed here: "
                             "pip install pandas (the same rows are in each run's metrics.csv)") from None
        return pd.DataFrame(self.columns())

    def load_csv(self, run_dir: str) -> int:
        """``run_dir``'s ``metrics.csv`` as the kernel that wrote it had it (a kept pool taken by this kernel: its
        curves go on from there), filed as that kernel filed it; the rows read. Its later rows are appended."""
        path = f"{run_dir}/{CSV_NAME}"
        try:
            with open(path, newline="") as f:
                rows = list(csv.reader(f))
        except OSError:
            return 0
        if not rows or tuple(rows[0][:len(COLUMNS)]) != COLUMNS:
            return 0
        header, names = rows[0], rows[0][len(COLUMNS):]
        with self.lock:  # (taken again by this kernel: the file is the whole story)
            self.chunks = [chunk for chunk in self.chunks if chunk[1] != run_dir]
        runs: dict[tuple, list] = {}  # (cell, rank) -> its rows, in order
        for row in rows[1:]:
            if len(row) == len(header):
                runs.setdefault((row[0], int(row[1])), []).append(row)
        for (cell, rank), got in runs.items():
            steps = [float(r[2]) for r in got]
            columns = {name: [float(r[len(COLUMNS) + i] or "nan") for r in got] for i, name in enumerate(names)}
            record = Scalars([int(x) if x.is_integer() else x for x in steps], [float(r[3]) for r in got],
                             {name: col for name, col in columns.items() if any(v == v for v in col)})  # (NaN != NaN)
            self.add(cell, run_dir, rank, record)
        with self.lock:
            self.written[run_dir] = (header, len(self.chunks))
        return len(rows) - 1

    def write_csv(self, run_dir: str) -> str | None:
        """``run_dir``'s rows into its ``metrics.csv``: the rows since the last write appended (a pool's cells),
        the whole file written anew only when a name first logged now widens its header."""
        path = f"{run_dir}/{CSV_NAME}"
        header, done = self.written.get(run_dir, (None, 0))
        if header is not None and not os.path.exists(path):  # (removed since: written anew, whole)
            header, done = None, 0
        with self.lock:
            upto = len(self.chunks)
        cols = self.columns(run_dir, since=done, upto=upto)
        if not cols["step"]:
            return None
        used = [name for name in list(cols)[len(COLUMNS):] if any(v == v for v in cols[name])]  # (NaN != NaN)
        if header is None or not set(used) <= set(header[len(COLUMNS):]):
            kept = set(used) | set((header or COLUMNS)[len(COLUMNS):])
            header = [*COLUMNS, *[name for name in cols if name in kept and name not in COLUMNS]]
            cols, mode = self.columns(run_dir, upto=upto), "w"
        else:
            mode = "a"
        out = [cols[c] if c in COLUMNS or all(v == v for v in cols[c]) else ["" if v != v else v for v in cols[c]]
               for c in header]
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if mode == "w" else os.O_APPEND)
        with open(os.open(path, flags, 0o600), mode, newline="") as f:  # private, as every file of a run
            writer = csv.writer(f)
            if mode == "w":
                writer.writerow(header)
            writer.writerows(zip(*out))
        self.written[run_dir] = (header, upto)
        return path


LOGBOOK = Logbook()


WRITE_EVERY_S = 0.5  # a cell's metrics.csv is brought up to date this often while it logs (and at its end): a
# kernel that dies mid-cell loses at most this much of what its ranks logged (a kept pool's next kernel reads the rest)


class Recorder:
    """A cell's listener: what its ranks log, filed in ``LOGBOOK`` under the cell's label, and appended to the run's
    ``metrics.csv`` as it comes (every ``WRITE_EVERY_S``) and at the cell's end."""

    def __init__(self, cell: str, run_dir, store: Logbook = LOGBOOK):
        self.cell, self.run_dir, self.store = cell, str(run_dir), store
        self.logged = False
        self.bars: dict = {}  # (rank, bar) -> the step its postfix was last taken at (metrics_chart.logged)
        self.written_at = time.monotonic()

    def on_Message(self, event) -> None:
        rec = metrics_chart.logged(event.rank, event.record, self.bars)
        if rec is not None:
            self.store.add(self.cell, self.run_dir, event.rank, rec)
            self.logged = True
            if time.monotonic() - self.written_at >= WRITE_EVERY_S:
                self.finish()

    def finish(self) -> None:
        if self.logged:
            self.logged, self.written_at = False, time.monotonic()
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
