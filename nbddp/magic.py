"""``%%ddp``: run the cell on every rank. Its options are declared here, so ``%%ddp?`` is the reference."""
from __future__ import annotations

import sys
import time

from IPython.core import magic_arguments
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from . import cell as cellmod
from . import launcher, results, tracebacks
from .display import view_for_session
from .errors import ResultError, UsageError

D = launcher.DEFAULTS  # every default below is read from the one Config


@magics_class
class DDPMagics(Magics):
    _handlers: list = []  # (shell, handler) registered by every instance: %unload_ext takes them back

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.cells: list[str] = []
        self.pool = None  # %ddp start's Pool, while one runs
        self.pool_options = ""
        if shell is not None:
            self.unregister_events(shell)  # %reload_ext: one recorder, not two
            shell.events.register("pre_run_cell", self._record)
            DDPMagics._handlers.append((shell, self._record))

    def _record(self, info) -> None:
        self.cells.append(info.raw_cell)

    @classmethod
    def unregister_events(cls, shell) -> None:
        for owner, handler in [h for h in cls._handlers if h[0] is shell]:
            try:
                shell.events.unregister("pre_run_cell", handler)
            except ValueError:
                pass
            cls._handlers.remove((owner, handler))

    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "-d", "--devices", default=D.devices,
        help="Ranks to start, Lightning-style: a count (4), GPU indices (0,2), -1 for all, or auto "
        "(all GPUs; one CPU rank). Default: auto.",
    )
    @magic_arguments.argument(
        "--accelerator", default=D.accelerator, choices=["auto", "cuda", "cpu"],
        help="auto: cuda when NVML sees a GPU, else cpu.",
    )
    @magic_arguments.argument(
        "--backend", default=D.backend, choices=["auto", "nccl", "gloo"],
        help="torch.distributed backend. auto: nccl on GPU, gloo on CPU.",
    )
    @magic_arguments.argument(
        "-o", "--out", nargs="+", default=[], metavar="NAME",
        help="Variables to bring back from rank 0 into the notebook (tensors arrive on the CPU; "
        "classes the notebook defined stay the notebook's own).",
    )
    @magic_arguments.argument(
        "-g", "--gather", nargs="+", default=[], metavar="NAME",
        help="Variables to bring back from every rank: NAME becomes a list of each rank's value, in rank order.",
    )
    @magic_arguments.argument(
        "--max-value-mb", type=float, default=D.max_value_mb, metavar="MB",
        help=f"Largest value (pickled) one rank may send back per name (default {D.max_value_mb:g} MiB); "
        "a larger one fails with its size, the other names still arrive.",
    )
    @magic_arguments.argument(
        "--start-method", default=D.start_method, choices=["fork", "spawn"],
        help="fork (default): ranks share the notebook's data copy-on-write. spawn: fresh interpreters; "
        "the cell and the globals it uses are pickled (for a kernel that already initialised CUDA).",
    )
    @magic_arguments.argument(
        "--seed", type=int, default=D.seed, metavar="N",
        help="Reproducible randomness: rank r's torch, random and numpy generators are seeded from N and r "
        "(Lightning's seed_everything, per rank). Default: fresh entropy per rank and run, as under torchrun; "
        "the notebook's own generators are never touched.",
    )
    @magic_arguments.argument(
        "--threads", type=int, default=D.threads,
        help="Intra-op threads per rank (torch.set_num_threads). Default 1: after the kernel has used "
        "OpenMP, a forked rank with more threads can hang on its first parallel op.",
    )
    @magic_arguments.argument(
        "--timeout", type=float, default=D.timeout, metavar="SECONDS",
        help="Wall-clock limit. At expiry every live rank's Python stack is shown and all ranks stop.",
    )
    @magic_arguments.argument(
        "--ranks-output", default=D.ranks_output, choices=["all", "0", "none"],
        help="Whose output (text and displays) the cell shows; every rank's text is kept in the run's log directory.",
    )
    @magic_arguments.argument(
        "--max-lines", type=int, default=D.max_lines, metavar="N",
        help=f"Lines per rank shown in the cell (default {D.max_lines}); the rest stays in the rank's log file.",
    )
    @magic_arguments.argument(
        "--max-line-chars", type=int, default=D.max_line_chars, metavar="N",
        help=f"Characters of one line shown in the cell (default {D.max_line_chars}); a longer line is cut, "
        "with a note; the whole line stays in the rank's log file.",
    )
    @magic_arguments.argument(
        "--max-output-mb", type=float, default=D.max_output_mb, metavar="MB",
        help=f"Text per rank shown in the cell, in MiB (default {D.max_output_mb:g}); the rest stays in the "
        "rank's log file.",
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
        result; ``--out`` names come back from rank 0, ``--gather`` names from every rank. A rank's
        ``display()``, ``plt.show()`` and rich outputs appear in the cell (other ranks' labelled with
        their rank). Nothing else in the notebook changes.

        Ranks start from fresh random state, different per rank and run, as under torchrun (``--seed N``
        reproduces). ``%load_ext nbddp`` imported torch once in the kernel, so ranks start in milliseconds.
        ``--threads N > 1`` is safe after the notebook ran torch ops (the kernel's idle OpenMP threads are
        released before the fork). ``%ddp start`` keeps ranks alive across cells (``%ddp?``).
        """
        args = magic_arguments.parse_argstring(self.ddp, line)
        if self.pool is not None and self.pool.alive:
            return self._in_pool(line, args, cell)
        config = launcher.Config(
            devices=args.devices, accelerator=args.accelerator, backend=args.backend,
            start_method=args.start_method, threads=args.threads, timeout=args.timeout,
            ranks_output=args.ranks_output, prefix=not args.no_prefix, max_lines=args.max_lines,
            max_line_chars=args.max_line_chars, max_output_mb=args.max_output_mb, max_value_mb=args.max_value_mb,
            seed=args.seed,
        )
        shell = self.shell
        source, filename, _ = self._compile(cell)
        plan = config.validate()  # bad options launch nothing (and before spawn pickles anything)
        shipped = None
        if args.start_method == "spawn":
            shipped = cellmod.ship_globals(source, filename, shell.user_ns)
        job = cellmod.CellJob(
            source, filename, outs=args.out, gathers=args.gather, max_value_bytes=config.max_value_bytes,
            namespace=shell.user_ns if args.start_method == "fork" else None, shipped=shipped,
        )
        observer = view_for_session()
        outcome = launcher.run(job, config, plan=plan, observer=observer, relabel=tracebacks.cell_labels(shell))
        for note in outcome.notes:
            print(f"nbddp: {note}", file=sys.stderr)
        return _deliver(outcome.results(), args.out, args.gather, shell.user_ns)

    def _compile(self, cell):
        shell = self.shell
        source = "\n" + shell.transform_cell(cell)  # line numbers count the %%ddp line, as the user sees it
        number = max(1, shell.execution_count - 1)  # IPython counts the running cell before it runs
        filename = shell.compile.cache(source, number, raw_code=cell)
        # a syntax error launches nothing, and shows as IPython shows it (Cell In[n], the line, the caret)
        body, last = cellmod.split_last_expression(source, filename, tracebacks.cell_labels(shell))
        return source, filename, cellmod.names_used(body) | (cellmod.names_used(last) if last else set())

    def _in_pool(self, line, args, cell):
        explicit = {a.dest: getattr(args, a.dest) for a in self.ddp.parser._actions
                    if any(tok == opt or tok.startswith(opt + "=") for opt in a.option_strings for tok in line.split())}
        clash = self.pool.conflicts(explicit)
        if clash:
            raise UsageError("this cell asks for " + ", ".join(clash) + ", which the running pool cannot change; "
                             "nothing ran.\nDrop those options, or %ddp restart with them (or %ddp stop to run "
                             "one-shot cells).")
        source, filename, names = self._compile(cell)
        per_rank = self.pool.cell(
            source, filename, outs=args.out, gathers=args.gather, code=names,
            relabel=tracebacks.cell_labels(self.shell), observer=view_for_session(lazy=True),
            timeout=args.timeout, ranks_output=args.ranks_output, prefix=not args.no_prefix,
            max_lines=args.max_lines, max_line_chars=args.max_line_chars, max_output_mb=args.max_output_mb,
            max_value_mb=args.max_value_mb,
        )
        try:
            return _deliver(per_rank, args.out, args.gather, self.shell.user_ns)
        finally:
            self.pool.synced.accept([*args.out, *args.gather], self.shell.user_ns)

    @line_magic("ddp")
    def ddp_pool(self, line):
        """%ddp start [options] | stop | restart [options] | status — ranks that live across cells.

        ``%ddp start`` forks one rank per device from the kernel (everything in the notebook is shared
        copy-on-write) and joins the process group once; every ``%%ddp`` cell then runs in those ranks,
        and what a cell defines there is there for the next one. ``start`` takes %%ddp's options
        (``--devices``, ``--accelerator``, ``--backend``, ``--threads``...). A notebook variable a cell
        reads that was created or rebound after the start is sent to every rank once. ``restart``
        re-forks (the way to share new big data copy-on-write); ``stop`` ends the ranks; ``status`` (or
        ``%ddp`` alone) shows them.
        """
        from .pool import NO_POOL, Pool

        verb, _, rest = line.strip().partition(" ")
        verb = verb or "status"
        if verb == "status":
            if self.pool is not None and self.pool.alive and self.pool.view.shown:
                self.pool.show()  # the pool's live dashboard, once more (the same output id)
            else:
                print(self.pool.status() if self.pool is not None else NO_POOL)
            return
        if verb == "stop":
            print("nbddp: pool stopped" if self._stop_pool() else "nbddp: no pool is running")
            return
        if verb in ("start", "restart"):
            if verb == "start" and self.pool is not None and self.pool.alive:
                raise UsageError("a pool is already running: %ddp restart [options] re-forks it, %ddp stop ends it.")
            rest = rest or (self.pool_options if verb == "restart" else "")
            args = magic_arguments.parse_argstring(self.ddp, rest)
            pool = Pool(self.shell.user_ns, devices=args.devices, accelerator=args.accelerator,
                        backend=args.backend, start_method=args.start_method, threads=args.threads,
                        seed=args.seed)
            pool.config.validate()  # bad options launch nothing, and the running pool stays
            self._stop_pool()
            t0 = time.monotonic()
            pool.start()
            self.pool, self.pool_options = pool, rest
            print(f"nbddp: pool of {pool.plan.world_size} rank(s) on {pool.plan.accelerator}/{pool.plan.backend} "
                  f"ready in {time.monotonic() - t0:.2f} s; %%ddp cells now run in it (%ddp stop ends it)", flush=True)
            if pool.view.shown:
                pool.show()  # its dashboard, below that line, live for the pool's life
            return
        raise UsageError(f"%ddp {verb}: say start [options], stop, restart [options] or status.")

    def _stop_pool(self) -> bool:
        if self.pool is None:
            return False
        self.pool.stop()
        self.pool = None
        return True

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


def _deliver(per_rank: list, outs: list[str], gathers: list[str], user_ns: dict):
    """--out names from rank 0, --gather names from every rank, into the notebook; every name that can
    arrive does, then one ResultError names each that could not (rank, name, why)."""
    problems = []
    arrived = []

    def load(rank: int, name: str, item):
        flag = "--out" if name in outs else "--gather"
        if item is None or item.problem == cellmod.NEVER_DEFINED:
            problems.append(f"{flag} {name}: rank {rank} never defined `{name}`.")
            return None, False
        if item.problem:
            problems.append(f"{flag} {name}: rank {rank}'s `{name}`: {item.problem}.")
            return None, False
        try:
            return results.loads(item.blob), True
        except Exception as e:  # noqa: BLE001 - a value the kernel cannot rebuild is named, not raised
            problems.append(f"{name}: rank {rank}'s value cannot be unpickled in the kernel: {type(e).__name__}: {e}.")
            return None, False

    first = per_rank[0]
    for name in outs:
        value, ok = load(0, name, first.outs.get(name))
        if ok:
            user_ns[name] = value
            arrived.append(name)
    for name in gathers:
        loaded = [load(r, name, res.gathers.get(name)) for r, res in enumerate(per_rank)]
        if all(ok for _, ok in loaded):
            user_ns[name] = [v for v, _ in loaded]
            arrived.append(name)
    if problems:
        problems.append(
            "The cell ran on every rank; " + (f"these arrived: {', '.join(arrived)}." if arrived else "nothing arrived.")
            + "\nSend plain data instead (tensors, numbers, dicts, a state_dict), or leave the name out."
        )
        raise ResultError("\n".join(problems))
    return results.loads(first.value.blob) if first.value is not None else None
