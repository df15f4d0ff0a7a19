"""A redesign must not make cells slower: ``python benchmarks/before_after.py REV [--rounds N]``.

Measures section 1's one-shot round trip and section 1c's pool cell (each with its anchor: a raw fork,
two forked ranks on a pipe) for this checkout and for git revision ``REV`` (checked out in a temporary
worktree), in kernels of their own that alternate (each side first in every other round), so drift, the order and
the machine's other load hit both alike. Prints the medians, each side's ratio to its own anchor, and after / before.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import kernel_code as kc  # noqa: E402
from run import POOL_CELLS, measures, new_kernel  # noqa: E402

# the one-shot cell and the pool cell, each with the anchor of the same kernel
FIGURES = {"one-shot %%ddp": ("round_trip", "nbddp %%ddp", "raw fork"), "pool %%ddp": ("pool", "pool", "floor")}


def measure(src: Path, runs: int) -> dict:
    """One kernel importing nbddp from ``src``: section 1 and 1c, as run.py runs them."""
    k = new_kernel({"PYTHONPATH": str(src)})
    try:
        found = k.value("__import__('nbddp').__file__")
        assert found.startswith(str(src)), f"the kernel imported nbddp from {found}, not {src}"
        k.ok("try:\n    from nbddp.kernel.ranks import warm\nexcept ImportError:  # a revision before kernel/ had folders\n"
             "    from nbddp.kernel import warm\nwarm.wait()")  # (before ad85344 the anchor's own fork could hang on it)
        out = measures(k.ok(kc.ROUND_TRIP.replace("{runs}", str(runs)), timeout=600))
        out.update(measures(k.ok(kc.POOL.replace("{runs}", str(POOL_CELLS * runs)), timeout=600)))
        return out
    finally:
        k.shutdown()


def render(result: dict) -> str:
    """results.md's section 10."""
    rev = result["rev"][:8]
    lines = [f"## 10. Before and after {result.get('what', 'the engine split (issue 36)')}", "",
             f"`python benchmarks/before_after.py {rev} --rounds {result['rounds']} --runs {result['runs']}`: sections "
             f"1 and 1c for {rev} (before) and for this code, in {2 * result['rounds']} kernels that "
             "alternate (each side first in every other round), each cell against its own anchor of the same kernel "
             "(a raw fork's round trip; two forked ranks on a pipe). Medians over the rounds:", "",
             f"| cell | before ({rev}) | × its anchor | after | × its anchor | after / before |",
             "|---|---|---|---|---|---|"]
    worst = 0.0
    for label, f in result["figures"].items():
        worst = max(worst, f["after"] / f["before"])
        lines.append(f"| {label} | {f['before'] * 1e3:.2f} ms | {f['before_ratio']:.2f}× | {f['after'] * 1e3:.2f} ms "
                     f"| {f['after_ratio']:.2f}× | {f['after'] / f['before']:.2f} |")
    lines += ["", f"Target: not slower (after / before ≤ 1.05) — {'met' if worst <= 1.05 else '**not met**'}. A run "
              "that always put \"before\" first in a round read 1.11 and 1.12: the kernel started second in a round was "
              "the slower one, whichever code it ran, so the sides alternate."]
    if result.get("note"):  # what was measured besides, to read this run by
        lines += ["", result["note"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rev", help="the revision before the change (e.g. a commit hash)")
    parser.add_argument("--rounds", type=int, default=3, help="kernels per side, alternating")
    parser.add_argument("--runs", type=int, default=5, help="section 1's runs per kernel (1c: 15 cells a run)")
    parser.add_argument("--what", default="a redesign", help="the change measured, as section 10's title says it")
    args = parser.parse_args()
    tree = Path(tempfile.mkdtemp(prefix="nbddp-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.rev], check=True,
                   capture_output=True)
    try:
        rows = {"before": [], "after": []}
        for i in range(args.rounds):  # each side first in every other round: the order's own effect evens out
            for side, src in (("before", tree), ("after", ROOT))[::1 if i % 2 == 0 else -1]:
                rows[side].append(measure(src, args.runs))
                print(side, json.dumps(rows[side][-1]["round_trip"]), flush=True)
        figures = {}
        for label, (section, key, anchor) in FIGURES.items():
            med = {side: statistics.median(r[section][key] for r in rs) for side, rs in rows.items()}
            ratio = {side: statistics.median(r[section][key] / r[section][anchor] for r in rs)
                     for side, rs in rows.items()}
            figures[label] = {"before": med["before"], "before_ratio": ratio["before"], "after": med["after"],
                              "after_ratio": ratio["after"]}
        result = {"rev": args.rev, "rounds": args.rounds, "runs": args.runs, "figures": figures, "what": args.what}
        path = HERE / "results.json"  # run.py writes it into results.md (section 10) with the rest
        path.write_text(json.dumps({**json.loads(path.read_text()), "before_after": result}, indent=1))
        print(render(result))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
