"""``%%ddp``: run the cell on every rank. Its options are declared here, so ``%%ddp?`` is the reference."""
from __future__ import annotations

from IPython.core import magic_arguments
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from . import cell as cellmod
from . import launcher, results
from .display import view_for_session
from .errors import ResultError


@magics_class
class DDPMagics(Magics):
    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.cells: list[str] = []
        if shell is not None:
            shell.events.register("pre_run_cell", lambda info: self.cells.append(info.raw_cell))

    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "-d", "--devices", default="auto",
        help="Ranks to start, Lightning-style: a count (4), GPU indices (0,2), -1 for all, or auto "
        "(all GPUs; one CPU rank). Default: auto.",
    )
    @magic_arguments.argument(
        "--accelerator", default="auto", choices=["auto", "cuda", "cpu"],
        help="auto: cuda when NVML sees a GPU, else cpu.",
    )
    @magic_arguments.argument(
        "--backend", default="auto", choices=["auto", "nccl", "gloo"],
        help="torch.distributed backend. auto: nccl on GPU, gloo on CPU.",
    )
    @magic_arguments.argument(
        "-o", "--out", nargs="+", default=[], metavar="NAME",
        help="Variables to bring back from rank 0 into the notebook (tensors arrive on the CPU).",
    )
    @magic_arguments.argument(
        "--start-method", default="fork", choices=["fork", "spawn"],
        help="fork (default): ranks share the notebook's data copy-on-write. spawn: fresh interpreters; "
        "the cell and the globals it uses are pickled (for a kernel that already initialised CUDA).",
    )
    @magic_arguments.argument(
        "--threads", type=int, default=1,
        help="Intra-op threads per rank (torch.set_num_threads). Default 1: after the kernel has used "
        "OpenMP, a forked rank with more threads can hang on its first parallel op.",
    )
    @magic_arguments.argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="Wall-clock limit. At expiry every live rank's Python stack is shown and all ranks stop.",
    )
    @magic_arguments.argument(
        "--ranks-output", default="all", choices=["all", "0", "none"],
        help="Whose output the cell shows (every rank's is kept in the run's log directory).",
    )
    @magic_arguments.argument(
        "--max-lines", type=int, default=200_000, metavar="N",
        help="Lines per rank shown in the cell (default 200000); the rest stays in the rank's log file.",
    )
    @magic_arguments.argument(
        "--no-prefix", action="store_true",
        help="Do not prefix lines with [rankN]: (handy with --ranks-output 0).",
    )
    @cell_magic
    def ddp(self, line, cell):
        """Run this cell on every rank of a torch.distributed job forked from the kernel.

        The cell sees the notebook's globals plus ``rank``, ``local_rank``, ``world_size`` and
        ``device``; the process group is initialised. Rank 0's last expression becomes the cell's
        result; ``--out`` names come back from rank 0. Nothing else in the notebook changes.
        """
        args = magic_arguments.parse_argstring(self.ddp, line)
        config = launcher.Config(
            devices=args.devices, accelerator=args.accelerator, backend=args.backend,
            start_method=args.start_method, threads=args.threads, timeout=args.timeout,
            ranks_output=args.ranks_output, prefix=not args.no_prefix, max_lines=args.max_lines,
        )
        shell = self.shell
        source = "\n" + shell.transform_cell(cell)  # line numbers count the %%ddp line, as the user sees it
        number = max(1, shell.execution_count - 1)  # IPython counts the running cell before it runs
        filename = shell.compile.cache(source, number, raw_code=cell)
        cellmod.split_last_expression(source, filename)  # a syntax error launches nothing
        plan = config.validate()  # bad options launch nothing (and before spawn pickles anything)
        shipped = None
        if args.start_method == "spawn":
            shipped = cellmod.ship_globals(source, filename, shell.user_ns)
        job = cellmod.CellJob(
            source, filename, outs=args.out,
            namespace=shell.user_ns if args.start_method == "fork" else None, shipped=shipped,
        )
        sink, observer = view_for_session()
        outcome = launcher.run(job, config, plan=plan, sink=sink, observer=observer,
                               relabel={filename: f"Cell In[{number}]"})
        return _deliver(outcome.values[0], args.out, shell.user_ns)

    @line_magic
    def ddp_export(self, line):
        """%ddp_export train.py: write this session's %%ddp cells (and the cells they need) for torchrun."""
        from .export import export_cells

        path = line.strip() or "train.py"
        # cells as typed ("%%ddp ...", not run_cell_magic(...)); front ends that run cells without
        # storing history (nbval, some IDEs) still reach pre_run_cell, which nbddp records from %load_ext on
        raw = self.shell.history_manager.input_hist_raw[1:] or self.cells
        history = [c for c in raw if not c.lstrip().startswith("%ddp_export")]
        with open(path, "w") as f:
            f.write(export_cells(history, source="this notebook session", script=path))
        print(f"wrote {path}: its first lines give the torchrun command")


def _deliver(packed: dict, outs: list[str], user_ns: dict):
    problems = []
    for name in outs:
        if name in packed["outs"]:
            user_ns[name] = results.loads(packed["outs"][name])
        elif name in packed["errors"]:
            problems.append(f"--out {name}: rank 0's `{name}` cannot be pickled ({packed['errors'][name]}).")
        elif name in packed["missing"]:
            problems.append(f"--out {name}: rank 0 never defined `{name}`.")
    if "__value__" in packed["errors"]:
        problems.append(f"the cell's last expression cannot be pickled ({packed['errors']['__value__']}).")
    if problems:
        arrived = [n for n in outs if n in packed["outs"]]
        problems.append(
            "The cell ran on every rank; " + (f"these arrived: {', '.join(arrived)}." if arrived else "nothing arrived.")
            + "\nMove what cannot be pickled to plain data (tensors, numbers, dicts), or leave it out of --out."
        )
        raise ResultError("\n".join(problems))
    return results.loads(packed["value"]) if packed["value"] is not None else None
