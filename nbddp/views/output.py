"""What the views publish: one output slot updated in place by display id, and tables as padded text."""
from __future__ import annotations

import uuid


class Slot:
    """One output in the cell, updated in place by display id (ipyparallel's pattern: it works in JupyterLab,
    VS Code and Colab alike, and the saved notebook keeps the last state). Bundles are built by the views:
    IPython's formatter machinery costs milliseconds per call, which every short run would pay.

    ``drawn``: the bundle last published (None: never shown)."""

    def __init__(self, prefix: str = ""):
        self.display_id = f"{prefix}{uuid.uuid4().hex[:12]}" if prefix else uuid.uuid4().hex
        self.drawn: dict | None = None

    def show(self, data: dict) -> None:
        """A new output (shown again, each copy stays live)."""
        self._publish(data, update=False)

    def update(self, data: dict) -> None:
        """Redrawn in place, when what it shows changed."""
        if data != self.drawn:
            self._publish(data, update=True)

    def _publish(self, data: dict, update: bool) -> None:
        from IPython.display import publish_display_data

        self.drawn = data
        publish_display_data(data, transient={"display_id": self.display_id}, update=update)


def text_table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as lines of text, each column padded to its widest cell (the header is a row)."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
