"""The house's shape, kept: no class over ``CLASS_LINES`` lines, no function over ``FUNCTION_LINES`` (issue 44),
so each stays readable in one sitting; a longer one is split by concern, not by size."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)

PACKAGE = Path(__file__).resolve().parent.parent / "nbddp"
CLASS_LINES, FUNCTION_LINES = 250, 80


def _too_long() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            size = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef) and size > CLASS_LINES:
                found.append(f"{path.relative_to(PACKAGE.parent)}: class {node.name}, {size} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > FUNCTION_LINES:
                found.append(f"{path.relative_to(PACKAGE.parent)}: {node.name}(), {size} lines")
    return found


def test_no_class_over_250_lines_and_no_function_over_80():
    assert not _too_long(), "split these by concern:\n" + "\n".join(_too_long())


def test_what_differs_by_kind_of_cell_is_asked_of_its_rules():
    """The engine never tells a one-shot gang from a pool's itself: rules.py's objects say what differs."""
    engine = PACKAGE / "kernel" / "cells" / "engine.py"
    asked = [n.lineno for n in ast.walk(ast.parse(engine.read_text()))
             if isinstance(n, ast.Attribute) and n.attr == "persistent"]
    assert not asked, f"engine.py reads gang.persistent at line(s) {asked}: ask the cell's rules (rules.py)"
