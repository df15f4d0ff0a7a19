"""The ``nbddp`` command: ``nbddp demo`` and ``nbddp env``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nbddp", description="Notebook-first torch.distributed launcher.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run a real %%ddp notebook (CPU, 2 ranks) headless and stream its output")
    sub.add_parser("env", help="show what nbddp detects here: session, fork support, devices")
    exp = sub.add_parser("export", help="write a notebook's %%ddp cells as a script for torchrun")
    exp.add_argument("notebook")
    exp.add_argument("-o", "--output", default="train.py")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo()
    if args.command == "export":
        from .export.script import export_notebook

        out = export_notebook(args.notebook, args.output)
        print(f"wrote {out}: its first lines give the torchrun command")
        return 0
    if args.command == "env":
        from . import environment

        print(environment())
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
