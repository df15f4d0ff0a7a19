"""Write docs/reference.md from the magic's own argument declarations: python docs/gen_reference.py"""
from pathlib import Path

HEADER = """# `%%ddp` reference

Generated from the magic's own `magic_arguments` by `python docs/gen_reference.py` (a test checks it is
current), so it says exactly what `%%ddp?` says in a notebook.

```text
"""


PROFILE = """
## `--profile`: where each rank's step goes

`%%ddp --profile [STEPS]` (5 steps if no number is given) runs torch.profiler on every rank for STEPS
optimizer steps, begun after the first step on every rank (so that a rank that started a second later is
no fake straggler). Steps are counted through torch's global optimizer hook: the cell's code is unchanged;
a loop without an optimizer counts its steps with `nbddp.rank.profile_session.step()`. The cell then shows, per
rank, a stacked bar of the profiled steps' time: compute, communication (time in collectives), of which
waiting for other ranks, data loading and other, and one line naming the straggler ("rank 1 is the
straggler: rank 0 spends 48 % of its step waiting in all_reduce for rank 1, whose own step is 70 % compute.").
Waiting is a rank's time in a collective before the last rank entered it (collectives matched across
ranks by their order of issue). `nbddp.profile()` returns the last profile as a pandas DataFrame (rank,
steps, step_s, compute_s, comm_s, wait_s, data_s, other_s: seconds summed over the profiled steps). Each
rank's trace is written beside its log, `rank{N}.trace.json` (Chrome/Perfetto JSON with
`distributedInfo`, as Holistic Trace Analysis reads it); the cell lists the paths. The rules of the split
are in `nbddp/rank/profile_session.py`'s docstring. Without `--profile` nothing of this runs.
"""


def render() -> str:
    from nbddp.kernel.magic import DDPMagics

    doc = DDPMagics.ddp.__doc__
    lines = [ln[8:] if ln.startswith(" " * 8) else ln for ln in doc.strip("\n").splitlines()]
    export_doc = " ".join(DDPMagics.ddp_export.__doc__.split())
    pool_doc = DDPMagics.ddp_pool.__doc__.strip("\n").splitlines()
    pool = [pool_doc[0].strip()] + [ln[8:] if ln.startswith(" " * 8) else ln for ln in pool_doc[1:]]
    return (HEADER + "\n".join(lines).rstrip() + "\n```\n\n## `%ddp`: a pool of ranks\n\n```text\n"
            + "\n".join(pool).rstrip() + "\n```\n\n## `%ddp_export`\n\n" + export_doc + "\n" + PROFILE)


if __name__ == "__main__":
    out = Path(__file__).with_name("reference.md")
    out.write_text(render())
    print("wrote", out)
