"""Choosing the views: a live widget dashboard in a Jupyter-like kernel, text elsewhere; a pool's own view."""
from __future__ import annotations

import functools
import importlib.util

from .dashboard import RunView
from ..ipy.session import running_shell, session_kind

WIDGET_SESSIONS = ("jupyter", "vscode", "colab", "kaggle")


@functools.lru_cache(maxsize=1)
def _ipywidgets_installed() -> bool:
    return importlib.util.find_spec("ipywidgets") is not None


def view_for_session(lazy: bool = False) -> RunView:
    """The run's view: the live dashboard in a Jupyter-like session, a text summary elsewhere.
    ``lazy`` (a pool's cells): nothing is shown unless the cell runs past the first 1 Hz tick or fails."""
    return RunView(widgets=_widgets(running_shell()), lazy=lazy)


@functools.lru_cache(maxsize=4)
def _widgets(shell) -> bool:
    """Asked once per shell (a session does not change kind; the check scans the environment)."""
    return session_kind(shell=shell) in WIDGET_SESSIONS and _ipywidgets_installed()


def view_for_pool(plan, run_dir):
    """A pool's own dashboard (poolview.py): shown and kept live in a Jupyter-like session."""
    from .poolview import PoolView

    return PoolView(plan, run_dir, shown=session_kind() in WIDGET_SESSIONS)
