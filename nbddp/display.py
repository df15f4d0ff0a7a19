"""What the cell shows while ranks run: prefixed lines (and, in a widget front end, the dashboard)."""
from __future__ import annotations

import contextlib

from .relay import TextSink


@contextlib.contextmanager
def display_for(shell, config):
    """Yield (sink, observer) for one run; the observer may be None (plain text)."""
    sink = TextSink()
    try:
        yield sink, None
    finally:
        sink.flush()
