"""Choosing the run's view: a live widget dashboard in a Jupyter-like kernel, text elsewhere."""
from __future__ import annotations

import functools
import importlib.util

from .dashboard import RunView
from .relay import TextSink
from .session import session_kind

WIDGET_SESSIONS = ("jupyter", "vscode", "colab", "kaggle")


@functools.lru_cache(maxsize=1)
def _ipywidgets_installed() -> bool:
    return importlib.util.find_spec("ipywidgets") is not None


def view_for_session() -> tuple[TextSink, RunView]:
    """(sink, observer) for one run: prefixed lines to the cell, and the dashboard or a text summary."""
    widgets = session_kind() in WIDGET_SESSIONS and _ipywidgets_installed()
    return TextSink(), RunView(widgets=widgets)
