"""The magics: ``%%ddp`` (a cell on every rank), ``%ddp`` (a pool: start, stop, restart, status; what each
verb does is verbs.py's) and ``%ddp_export``. Their options come from options.OPTIONS, so ``%%ddp?`` is the
reference; each cell goes to the one cell engine (engine.py), one-shot or in the pool."""
from __future__ import annotations

import contextlib
import sys

from IPython.core import magic_arguments
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from ..errors import UsageError
from ..ipy import cellcode, cells, debugger, tracebacks
from ..views import output
from ..views.display import line_for_pool_cell, view_for_session
from ..wire import messages
from . import checks, options
from .cells import engine
from .cells.background import Background, Job, WaitForNames
from .names import delivery, sending
from .names.history import History, request_metadata
from .ranks import starters
from .verbs import Verbs


def option_groups(func):
    """``%%ddp``'s argument groups, declared from options.OPTIONS (magic_arguments builds ``%%ddp?``)."""
    specs = list(options.argument_specs())
    for i in range(len(specs) - 1, -1, -1):  # decorators apply from the bottom up
        title, flags, kw = specs[i]
        func = magic_arguments.argument(*flags, **kw)(func)
        if i == 0 or specs[i - 1][0] != title:
            func = magic_arguments.argument_group(title)(func)
    func = magic_arguments.magic_arguments()(func)
    func.__doc__ = readable(func.__doc__, "%%ddp [options]", DDP_EXAMPLE)
    return func


DDP_EXAMPLE = """\
%%ddp --devices 2 --gather losses
model = DDP(torch.nn.Linear(64, 1).to(device))   # rank, world_size, device are set; the group is up
losses = train(model)                            # every rank's list comes back as `losses`"""

POOL_EXAMPLE = """\
%ddp start --devices 2          # fork once; then every %%ddp cell runs in these ranks
%ddp status                     # the pool's dashboard again
%ddp stop                       # end the ranks; %%ddp cells are one-shot again"""


def readable(doc: str, usage: str, example: str) -> str:
    """A magic's help as a user reads it in ``%%ddp?``: the usage and an example first, no reST markup
    (argparse's ``::`` usage block with every flag, double backticks)."""
    import re
    import textwrap

    lines = doc.splitlines()
    if lines and lines[0].strip() == "::":  # magic_arguments' usage: the groups below list each option
        end = next((i for i in range(2, len(lines)) if not lines[i].strip()), len(lines))
        lines = lines[end + 1:]
    body = re.sub(r"``(.+?)``", r"\1", textwrap.dedent("\n".join(lines)).strip("\n"))
    # prose paragraphs flow again (dropping the backticks left ragged lines); argparse's groups keep their layout
    body = "\n\n".join(p if any(ln.startswith(" ") for ln in p.splitlines())
                       else textwrap.fill(" ".join(p.split()), 100, break_on_hyphens=False)
                       for p in body.split("\n\n"))
    return f"{usage}\n\n{textwrap.indent(example, '    ')}\n\n{body}\n"


_write_script = None  # what %ddp_export writes the script with (register_exporter)


def register_exporter(export_cells) -> None:
    """``export_cells(cells, source=, script=, failed=, left_out=)`` writes ``%ddp_export``'s torchrun script
    (export/script.py). export/ reads the options table, so it sits above the kernel: the package that
    loads the magics registers it (nbddp's ``__init__``), and the magic names no export module."""
    global _write_script
    _write_script = export_cells


EMPTY_CELL = ("%%ddp: the cell is empty: nothing below the %%ddp line for the ranks to run; nothing ran.\n"
              "Write the ranks' code below `%%ddp [options]`; a pool is managed with the line magic %ddp "
              "(single %): %ddp start, stop, status, debug, who, diff.")


def keep_empty_body(lines: list[str]) -> list[str]:
    """IPython refuses a cell magic whose body is empty before calling it, printing its own UsageError (the
    cell is not failed with an error, as nbddp's usage errors fail it); a blank line keeps the body, so
    ``%%ddp`` refuses it itself (``EMPTY_CELL``). One check of the first line per cell."""
    if len(lines) == 1 and lines[0].startswith("%%ddp") and not lines[0].startswith("%%ddp?"):
        return [lines[0].rstrip("\n") + "\n", "\n"]
    return lines


@magics_class
class DDPMagics(Magics):
    _handlers: list = []  # (shell, event, handler) registered by every instance: %unload_ext takes them back

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.history = History()  # the session's cells, each once, for %ddp_export (history.py)
        self.pool = None  # %ddp start's Pool, while one runs
        self.pool_options = ""
        self._pdb_back = False  # %pdb was on and a cell's traceback was shown without it (ranks_debug_themselves)
        self._compiled = cellcode.Compiled()  # each cell's text compiled once (a pool's cells run again)
        self.background = Background(shell)  # %%ddp --bg cells, and what became of them
        self.background.on_failed = self._failed_in_background
        self.verbs = Verbs(self)  # what %ddp VERB does (verbs.py)
        if shell is not None:
            self.unregister_events(shell)  # %reload_ext: one recorder, not two
            self.history.loaded(shell)
            # the turn first: a queued background cell's start (names read, ranks forked) is never mid-cell
            for event, handler in (("pre_run_cell", self.background.turns.cell_begins), ("pre_run_cell", self._record),
                                   ("post_run_cell", self._ran), ("pre_run_cell", self._land),
                                   ("post_run_cell", self.background.turns.cell_ends)):
                shell.events.register(event, handler)
                DDPMagics._handlers.append((shell, event, handler))
            shell.input_transformers_cleanup.append(keep_empty_body)
            shell.ast_transformers.append(WaitForNames(self.background, shell))

    def _failed_in_background(self, job) -> None:
        """A background cell's work failed after its notebook cell returned: %ddp_export leaves it out."""
        first = (str(job.error).splitlines() or [""])[0]
        self.history.failed_later(job.number, f"{type(job.error).__name__}: {first}".rstrip(": "))

    def _land(self, info) -> None:
        """Background cells that ended since the last cell: their results land now, their failures are said."""
        if self.background.jobs and not info.raw_cell.lstrip().startswith("%ddp wait"):  # (it says them itself)
            self.background.land()

    def _record(self, info) -> None:
        meta = request_metadata(self.shell, info)  # the front end's cell id, and the cells it deleted
        self.history.started(info.raw_cell, meta.get("cellId"), meta.get("deletedCells"))
        pool = self.pool
        if pool is not None and pool.alive and not info.raw_cell.lstrip().startswith(("%%ddp", "%ddp")):
            # what this notebook cell binds is the notebook's latest word, sent even if equal to an older value
            try:
                source = self.shell.transform_cell(info.raw_cell)
            except Exception:  # noqa: BLE001 - a cell IPython cannot transform binds nothing we can see
                return
            pool.notebook_bound(cellcode.names_bound(source))

    @contextlib.contextmanager
    def ranks_debug_themselves(self):
        """With IPython's %pdb on, a failed rank was debugged in the rank itself; IPython's own post-mortem
        would open in nbddp's kernel-side frames, so it is off for this cell's traceback (on again after)."""
        ok = False
        try:
            yield
            ok = True
        finally:
            if not ok and getattr(self.shell, "call_pdb", False):  # any way out, an interrupt too
                self.shell.call_pdb = False
                self._pdb_back = True

    def _ran(self, result) -> None:
        if self._pdb_back:
            self.shell.call_pdb, self._pdb_back = True, False
        error = result.error_before_exec or result.error_in_exec
        why = None if error is None else f"{type(error).__name__}: {error}".strip().rstrip(":")
        self.history.ended(getattr(getattr(result, "info", None), "raw_cell", None), result.execution_count, why)

    @classmethod
    def unregister_events(cls, shell) -> None:
        for owner, event, handler in [h for h in cls._handlers if h[0] is shell]:
            try:
                shell.events.unregister(event, handler)
            except ValueError:
                pass
            cls._handlers.remove((owner, event, handler))
        while keep_empty_body in shell.input_transformers_cleanup:
            shell.input_transformers_cleanup.remove(keep_empty_body)
        WaitForNames.remove(shell)

    @option_groups
    @cell_magic
    def ddp(self, line, cell):
        """Run this cell on every rank of a torch.distributed job forked from the kernel.

        The cell sees the notebook's globals plus ``rank``, ``local_rank``, ``world_size`` and
        ``device``; the process group is initialised. Rank 0's last expression becomes the cell's
        result; ``--out`` names come back from rank 0, ``--gather`` names from every rank. Nothing else
        in the notebook changes.

        Each rank's output arrives as whole ``[rankN]:`` lines (a line every rank printed alike, once,
        as ``[rank0-1]:``); its ``display()``, ``plt.show()`` and rich outputs labelled with its rank; its
        tqdm bars as progress bars. Above them a dashboard shows every rank's state, progress, time,
        memory and last line, and stays as the cell's summary.

        Ranks start from fresh random state, different per rank and run, as under torchrun (``--seed N``
        reproduces). ``%load_ext nbddp`` imported torch once in the kernel, so ranks start in milliseconds.
        ``--threads N > 1`` is safe after the notebook ran torch ops (the kernel's idle OpenMP threads are
        released before the fork). ``%ddp start`` keeps ranks alive across cells (``%ddp?``).
        """
        with self.ranks_debug_themselves():
            return self._cell(line, cell)

    def _cell(self, line, cell):
        explicit = options.parse(line)  # bad input is refused here: nothing runs, nothing changes
        if not cell.strip():
            raise UsageError(EMPTY_CELL)
        given, names = options.split(explicit)
        in_background = names.pop("background", False)
        if not in_background:  # never two cells in the ranks at once
            self.background.before_foreground("this %%ddp cell")
        outs, gathers = names.get("out", []), names.get("gather", [])
        if self.pool is not None and self.pool.alive:
            work, deliver = self._in_pool(given, outs, gathers, cell, names.get("ranks"))
        elif self.pool is not None and self.pool.ended:  # never a silent one-shot cell instead
            raise UsageError(self.pool.lost())
        elif "ranks" in names:
            raise UsageError("--ranks runs a cell on some ranks of a running pool, and no pool is running; nothing "
                             "ran.\n%ddp start [options] starts one; a one-shot cell runs on every rank it starts "
                             "(--devices N).")
        else:
            work, deliver = self._one_shot(given, outs, gathers, cell, queued=in_background)
        if not in_background:
            return deliver(work(None))
        return self._in_background(work, deliver, (*outs, *gathers), cell)

    def _one_shot(self, given: dict, outs, gathers, cell, queued: bool = False):
        """A one-shot cell, checked and made ready: (work(on_start) -> each rank's Result, deliver)."""
        config = options.config(given)
        shell = self.shell
        source, filename, _ = self._compiled.get(self.shell, cell)
        filename = debugger.cell_file(shell, filename)  # the debugger panel's breakpoints are set there
        plan = checks.preflight(config, queued=queued)  # everything that refuses, before spawn pickles anything
        method = starters.starter_for(plan)
        # fork: the ranks share the notebook as it is now; spawn, forkserver: the globals the cell reads travel
        # with it (tensors and arrays through shared memory)
        updates = {} if method.inherits_notebook else sending.ship_globals(
            source, filename, shell.user_ns, method=method.name, advice=method.unsent_advice,
            gpu_ipc=method.gpu_ipc(plan))
        for note in sending.shipped_notes(updates, shell.user_ns) if updates else ():
            print(f"nbddp: {note}", file=sys.stderr)
        cmd = messages.RunCell(source, filename, tuple(outs), tuple(gathers), options.max_value_bytes(config), updates,
                               post_mortem=bool(getattr(shell, "call_pdb", False)), debug=debugger.rank_setup())
        relabel = tracebacks.cell_labels(shell)
        observer = view_for_session()

        def work(on_start):
            outcome = engine.one_shot(cmd, config, plan=plan, namespace=shell.user_ns, observer=observer,
                                      relabel=relabel, on_start=on_start)
            for note in outcome.notes:
                output.current().write("stderr", f"nbddp: {note}\n")
            return outcome.results()

        work.observer = observer
        return work, lambda per_rank: delivery.deliver(per_rank, outs, gathers, shell.user_ns, source)

    def _in_background(self, work, deliver, names, cell):
        """``--bg``: the cell goes to the background thread (Background); this cell returns once its ranks
        have it. Rank 0's last expression is shown in the background cell's output when it ends."""
        shell = self.shell

        def work_and_show(on_start):
            return delivery.shown_in_place(work(on_start), shell)

        number = cells.running(shell)
        code_lines = (ln.strip() for ln in cell.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))
        label = next(code_lines, "")[:60]
        job = Job(number, label, work_and_show, deliver, tuple(names),
                  output.Detached(output.kernel_sockets(), output.request_header()),
                  observer=getattr(work, "observer", None))
        self.background.submit(job)
        return None

    def _in_pool(self, given: dict, outs, gathers, cell, ranks=None):
        """A pool cell, checked and made ready: (work(on_start) -> each rank's Result, deliver)."""
        clash = self.pool.conflicts(given)
        if clash:
            raise UsageError("this cell asks for " + ", ".join(clash) + ", which the running pool cannot change; "
                             "nothing ran.\nDrop those options, or %ddp restart with them (or %ddp stop to run "
                             "one-shot cells).")
        per_cell = {k: v for k, v in given.items() if k not in options.POOL_FIXED}
        source, filename, names = self._compiled.get(self.shell, cell)
        filename = debugger.cell_file(self.shell, filename)  # the debugger panel's breakpoints are set there
        pool, user_ns = self.pool, self.shell.user_ns
        relabel, observer = tracebacks.cell_labels(self.shell), line_for_pool_cell(ranks)
        post_mortem = bool(getattr(self.shell, "call_pdb", False))

        def work(on_start):
            # (a --cluster pool's ranks are no children of the kernel's, which its debugger reaches: never connected)
            return pool.cell(source, filename, outs=outs, gathers=gathers, code=names, relabel=relabel,
                             observer=observer, ranks=ranks, post_mortem=post_mortem, on_start=on_start,
                             debug=None if pool.config.cluster else debugger.rank_setup(), **per_cell)

        def deliver(per_rank):
            try:
                return delivery.deliver(per_rank, outs, gathers, user_ns, source)
            finally:
                pool.held.came_back([*outs, *gathers])  # (from the ranks: nothing to send back)

        work.observer = observer
        return work, deliver

    @line_magic("ddp")
    def ddp_pool(self, line):
        """%ddp start [options] | stop | restart [options] | resize N | status — ranks that live across cells.

        ``%ddp start`` forks one rank per device from the kernel (everything in the notebook is shared
        copy-on-write) and joins the process group once; every ``%%ddp`` cell then runs in those ranks,
        and what a cell defines there is there for the next one. ``start`` takes %%ddp's options (see
        ``%%ddp?``): the "Ranks" group holds for the pool's life, the per-cell ones become its cells'
        defaults (a cell's own win); ``--out``/``--gather`` belong on a cell. A notebook variable a cell
        reads that was created or rebound after the start is sent to every rank once. ``restart``
        re-forks (the way to share new big data copy-on-write; bad options leave the running pool as it
        is); ``resize N`` grows or shrinks the running pool to N ranks, its state kept (new ranks take it
        from a peer); ``stop`` ends the ranks; ``status`` (or ``%ddp`` alone) shows them. A rank the pool
        loses (killed, out of memory, a crash) is said at once and mended as ``--on-loss`` says: heal
        (default: a replacement takes the pool's state from a peer), shrink, or end. A pool outlives its
        kernel for 10 minutes if the kernel is killed or crashes (``--keep DURATION``: that long, across a
        deliberate restart too; ``--keep off``: never): ``%ddp pools`` lists the kept pools,
        ``%ddp attach [ID]`` takes one into this kernel, ``%ddp stop ID`` ends one; ``%ddp detach`` hands
        this kernel's pool to its keeper now, kept as it is (for another kernel, or this one once restarted).
        """
        return self.verbs.run(line)

    @line_magic
    def ddp_export(self, line):
        """%ddp_export train.py: write this session's %%ddp cells (and the cells they need) for torchrun."""
        path = line.strip() or "train.py"
        if _write_script is None:
            raise UsageError("%ddp_export: load the magics with %load_ext nbddp (it hands them the script writer).")
        # each cell once, as typed ("%%ddp ...", not run_cell_magic(...)) and last run without an error
        session = self.history.export()
        with open(path, "w") as f:
            f.write(_write_script(session.cells, source="this notebook session", script=path, failed=session.failed,
                                  left_out=session.left_out))
        print(f"wrote {path}: its first lines give the torchrun command")


_usage, _, _rest = DDPMagics.ddp_pool.__doc__.partition("\n")
DDPMagics.ddp_pool.__doc__ = readable(_rest, _usage, POOL_EXAMPLE)
