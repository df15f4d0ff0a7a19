"""Choosing the views: a cell's dashboard updated in place in a Jupyter-like front end, text elsewhere;
a pool cell's one line; a pool's own view."""
from __future__ import annotations

import functools

from ..ipy.session import running_shell, session_kind
from .dashboard import CellLine, RunView

LIVE_SESSIONS = ("jupyter", "vscode", "colab", "kaggle")


def view_for_session() -> RunView:
    """A one-shot cell's view: the dashboard in a Jupyter-like session, a text summary elsewhere."""
    return RunView(live=_live(running_shell()))


def line_for_pool_cell(ranks=None) -> CellLine:
    """A pool cell's view: its one line, live from the pool's first tick of a cell past a second, then its
    final line (the pool's own view has the detail); ``ranks``: --ranks."""
    return CellLine(live=_live(running_shell()), ranks=ranks)


@functools.lru_cache(maxsize=4)
def _live(shell) -> bool:
    """Asked once per shell (a session does not change kind; the check scans the environment)."""
    return session_kind(shell=shell) in LIVE_SESSIONS


def view_for_pool(plan, run_dir):
    """A pool's own dashboard (poolview.py): shown and kept live in a Jupyter-like session."""
    from .poolview import PoolView

    return PoolView(plan, run_dir, shown=session_kind() in LIVE_SESSIONS)
