"""Write docs/reference.md from the magic's own argument declarations: python docs/gen_reference.py"""
from pathlib import Path

HEADER = """# `%%ddp` reference

Generated from the magic's own `magic_arguments` by `python docs/gen_reference.py` (a test checks it is
current), so it says exactly what `%%ddp?` says in a notebook.

```text
"""


def render() -> str:
    from nbddp.kernel.magic import DDPMagics

    doc = DDPMagics.ddp.__doc__
    lines = [ln[8:] if ln.startswith(" " * 8) else ln for ln in doc.strip("\n").splitlines()]
    export_doc = " ".join(DDPMagics.ddp_export.__doc__.split())
    pool_doc = DDPMagics.ddp_pool.__doc__.strip("\n").splitlines()
    pool = [pool_doc[0].strip()] + [ln[8:] if ln.startswith(" " * 8) else ln for ln in pool_doc[1:]]
    return (HEADER + "\n".join(lines).rstrip() + "\n```\n\n## `%ddp`: a pool of ranks\n\n```text\n"
            + "\n".join(pool).rstrip() + "\n```\n\n## `%ddp_export`\n\n" + export_doc + "\n")


if __name__ == "__main__":
    out = Path(__file__).with_name("reference.md")
    out.write_text(render())
    print("wrote", out)
