"""One section of results.md kept by a bench_*.py script run on its own (``python benchmarks/bench_X.py``): its
figures into results.json under its name, its text between its markers in results.md (run.py writes the whole
file from results.json, each such section between the same markers)."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def save(name: str, r: dict, block: str, begin: str, end: str, before: str | None = None) -> None:
    """``block``: the section's text, its markers ``begin`` and ``end`` included; where results.md has no such
    section yet, it goes before the heading ``before`` (else at the end)."""
    path = HERE / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[name] = r
    path.write_text(json.dumps(results, indent=1))
    md = HERE / "results.md"
    text = md.read_text() if md.exists() else ""
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    elif before is not None and before in text:
        at = text.index(before)
        text = text[:at] + block + "\n\n" + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    md.write_text(text)
