"""Every option of a run, once: name, flags, default, choices, scope, help text and check.

The magics' argument groups (``%%ddp?``), what ``%ddp start`` accepts, ``Config`` and its validation,
the pool's clash check, ``nbddp.launch``'s keywords and docs/reference.md all derive from ``OPTIONS``.
Scopes: ``launch`` options are fixed when ranks start (for a pool, its whole life); ``cell`` options
hold for one cell (given at ``%ddp start`` they become the pool's defaults for its cells); ``names``
options (``--out``, ``--gather``, ``--ranks``) belong to one ``%%ddp`` cell only. What ``--on-loss``'s values
mean is here too, one object each (``OnLoss``, ``Config.loss_policy``): no other module compares its names.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass

from .. import units
from ..errors import UsageError
from ..wire import values

LAUNCH, CELL, NAMES = "launch", "cell", "names"


@dataclass(frozen=True)
class Option:
    name: str  # the keyword (nbddp.launch, Pool) and the Config field
    flags: tuple  # as the magic takes it
    default: object
    help: str
    scope: str = CELL
    group: str = "output"
    type: object = str
    choices: tuple = ()
    metavar: str | None = None
    nargs: object = None  # argparse's, for a cell's own options (--out NAME [NAME ...]); "?": the value may be left out
    const: object = None  # with nargs "?": the value of the flag given alone (--profile: 5 steps)
    need: str = ""  # what a good value is, as the refusal says it ("a whole number >= 1")
    ok: object = None  # value -> bool, for values the type and choices do not already settle

    @property
    def flag(self) -> str:
        return self.flags[-1]

    def check(self, value) -> str | None:
        """Why ``value`` cannot be used, naming the option and what would do; None if it can."""
        if self.choices and value not in self.choices:
            return f"{self.flag} {value!r}: choose {', '.join(map(str, self.choices))}."
        if self.ok is not None and not _holds(self.ok, value):
            return f"{self.flag} {value!r}: need {self.need}."
        return None


KEEP_MAX_S = 7 * 86400  # the longest --keep: a kept pool never outlives the user's session without a limit
# --keep's default: a pool kept this long if its kernel ends unplanned (killed, crashed, out of memory), never
# across a deliberate shutdown or restart (Jupyter's shutdown_request, exit()); where a pool cannot be kept
# (--cluster, a forkserver pool, no pidfds) it ends with its kernel, as with off
KEEP_AUTO, KEEP_AUTO_S = "auto", 600.0


def keep_asked(conf) -> bool:
    """--keep was given a duration (not its default, not off): a pool that cannot be kept is then refused."""
    return conf.keep not in ("off", KEEP_AUTO)


def _duration(text) -> bool:
    try:
        return units.seconds(text) <= KEEP_MAX_S
    except ValueError:
        return False


def _rank_list(text: str) -> tuple:
    """``0`` or ``0,2`` (or ``0-3``) -> (0,) or (0, 2): ranks, each once, in order."""
    ranks = []
    for part in str(text).split(","):
        lo, dash, hi = part.strip().partition("-")
        ranks += range(int(lo), int(hi) + 1) if dash else [int(lo)]
    if not ranks or min(ranks) < 0:
        raise ValueError(text)
    return tuple(sorted(set(ranks)))


_rank_list.__name__ = "ranks (such as 0 or 0,2)"  # argparse's refusal: "invalid ranks (such as 0 or 0,2) value"


def _steps(text: str) -> int:
    return int(text)


_steps.__name__ = "number of steps (such as 10)"  # argparse's refusal: "invalid number of steps ... value: 'x'"


def _holds(test, value) -> bool:
    try:
        return bool(test(value))
    except (TypeError, ValueError):
        return False


def _whole(low):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _size(positive):
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 if positive else v >= 0)


GROUPS = {
    "ranks": "Ranks (fixed when the ranks start: for a pool, its whole life)",
    "pool": "A pool's cell (one %%ddp cell in a running pool)",
    "background": "In the background (one %%ddp cell)",
    "values": "Values back into the notebook (one %%ddp cell)",
    "output": "Output, limits and time (per cell; at %ddp start: the pool's defaults)",
}


@dataclass(frozen=True)
class OnLoss:
    """What a pool does when it loses a rank (killed, out of memory, a crash): ``--on-loss``'s value, made once
    (``ON_LOSS``), found from a config by ``Config.loss_policy``. ``Pool.start`` hands it to the pool's gang and the
    gang's supervisor once the ranks are up, and every part that handles a loss asks it: the supervisor
    (``Supervisor.on_loss``), the cells' rules (rules.PoolRules) and the pool's mending (kernel/healing/)."""

    name: str  # as --on-loss says it
    keeps_peers: bool  # a rank that dies leaves its peers running (else its supervisor stops them at once)
    mends: bool  # the pool mends itself, in the kernel (else it ends with the loss)
    replaces: bool = False  # mending forks a replacement for each lost rank (heal), else renumbers the survivors
    doing: str = ""  # the pool's view while it mends: "healing: rank(s) 2 lost"


ON_LOSS = {policy.name: policy for policy in (
    OnLoss("heal", keeps_peers=True, mends=True, replaces=True, doing="healing"),
    OnLoss("shrink", keeps_peers=True, mends=True, doing="shrinking"),
    OnLoss("end", keeps_peers=False, mends=False),
)}
# a node's agent's supervisor (cluster/agent.py): its ranks' peers stay up; what becomes of the pool, the kernel says
KERNEL_DECIDES = OnLoss("the kernel's", keeps_peers=True, mends=False)

OPTIONS = (
    Option("devices", ("-d", "--devices"), "auto", scope=LAUNCH, group="ranks",
           help="Ranks to start, Lightning-style: a count (4), GPU indices (0,2), -1 for all, or auto "
           "(all free GPUs; one CPU rank). Default: auto."),
    Option("accelerator", ("--accelerator",), "auto", scope=LAUNCH, group="ranks", choices=("auto", "cuda", "cpu"),
           help="auto: cuda when NVML sees a GPU, else cpu."),
    Option("backend", ("--backend",), "auto", scope=LAUNCH, group="ranks", choices=("auto", "nccl", "gloo"),
           help="torch.distributed backend. auto: nccl on GPU, gloo on CPU."),
    Option("start_method", ("--start-method",), "auto", scope=LAUNCH, group="ranks",
           choices=("auto", "fork", "forkserver", "spawn"),
           help="auto (default): fork, but GPU ranks of a kernel that holds CUDA start from the forkserver (said in "
           "the cell). fork: ranks share the notebook's data copy-on-write. forkserver: forked from a process "
           "that never initialised CUDA, warm with the kernel's imports; the globals the cell reads are sent, "
           "tensors and arrays through shared memory. spawn (one-shot cells only): fresh interpreters."),
    Option("threads", ("--threads",), 1, scope=LAUNCH, group="ranks", type=int, metavar="N", need="a whole number >= 1",
           ok=_whole(1), help="Intra-op threads per rank (torch.set_num_threads). Default 1; more is safe after "
           "the notebook ran torch ops (the kernel's idle OpenMP threads are released before the fork)."),
    Option("seed", ("--seed",), None, scope=LAUNCH, group="ranks", type=int, metavar="N", need="a whole number >= 0",
           ok=lambda v: v is None or _whole(0)(v),
           help="Reproducible randomness: rank r's torch, random and numpy generators are seeded from N and r. "
           "Default: fresh entropy per rank and run, as under torchrun; the notebook's own are never touched."),
    Option("cluster", ("--cluster",), None, scope=LAUNCH, group="ranks", metavar="ray[:ADDRESS]",
           need="ray, or ray:ADDRESS (a Ray cluster's address; not a ray:// client address)",
           ok=lambda v: v is None or (v == "ray" or v.startswith("ray:")) and not v.startswith("ray:ray://"),
           help="A pool across the nodes of a Ray cluster (pools only): the kernel's node runs ranks "
           "0..D-1, forked from the kernel; an agent on each other node forks its ranks. ray: the cluster the "
           "notebook connected to with ray.init (or this machine's); ray:ADDRESS connects to that one. See "
           "docs/ray.md."),
    Option("nodes", ("--nodes",), 1, scope=LAUNCH, group="ranks", type=int, metavar="N", need="a whole number >= 1",
           ok=_whole(1), help="Nodes of the --cluster a pool spans, --devices ranks on each (node 0 is the "
           "kernel's). Default 1."),
    Option("on_loss", ("--on-loss",), "heal", scope=LAUNCH, group="ranks", choices=tuple(ON_LOSS),
           help="What a pool does when it loses a rank (killed, out of memory, a crash): heal (default) forks a "
           "replacement with the same rank and device, which takes the pool's state from a surviving peer; "
           "shrink goes on with the survivors, renumbered; end ends the pool. See docs/user-guide.md, \"When a "
           "rank is lost\"."),
    Option("keep", ("--keep",), KEEP_AUTO, scope=LAUNCH, group="ranks", metavar="DURATION", nargs="?", const="1h",
           need="a duration (30s, 10m, 2h; at most 7 days), auto or off",
           ok=lambda v: v in ("off", KEEP_AUTO) or _duration(v),
           help="Keep the pool when its kernel ends (pools only): killed, crashed, out of memory, restarted, shut "
           "down. Its ranks, their state and a running --bg cell live on for DURATION (--keep alone: 1h) and wait "
           "for a kernel: %%load_ext nbddp there lists them, %%ddp attach (or the same %%ddp start in the same "
           "notebook) takes one. Only you can reach it (a socket in a directory of yours). Default auto: kept "
           f"{KEEP_AUTO_S / 60:g} minutes if the kernel is killed or crashes, ended by a deliberate shutdown or "
           "restart, and not kept where it cannot be (--cluster, a forkserver pool). off: the pool always ends with "
           "its kernel. See docs/user-guide.md, \"When the kernel restarts\"."),
    Option("ranks", ("--ranks",), (), scope=NAMES, group="pool", type=_rank_list, metavar="R[,R...]",
           help="Run the cell on these ranks of the pool only (0 or 0,2), to look at or fix one rank's state; a "
           "collective called there fails fast, and the pool lives on. Its last expression and --out come from "
           "the first of them, --gather from each."),
    Option("background", ("--bg",), False, scope=NAMES, group="background", type=bool,
           help="Run the cell in the background: the notebook cell returns once the ranks have it, and the "
           "notebook goes on meanwhile. Its output keeps arriving in this cell (JupyterLab); %%ddp status shows "
           "the work, %%ddp attach shows it live in another cell (after a page reload), %%ddp wait waits for it, "
           "%%ddp interrupt stops it. Its --out/--gather names land in the notebook when it has ended, at the "
           "next cell; a cell that reads one waits for it. A second --bg cell queues behind the first; a "
           "blocking %%%%ddp cell waits for both."),
    Option("out", ("-o", "--out"), (), scope=NAMES, group="values", metavar="NAME", nargs="+",
           help="Variables to bring back from rank 0 into the notebook (tensors arrive on the CPU; classes the "
           "notebook defined stay the notebook's own)."),
    Option("gather", ("-g", "--gather"), (), scope=NAMES, group="values", metavar="NAME", nargs="+",
           help="Variables to bring back from every rank: NAME becomes a list of each rank's value, in rank order."),
    Option("max_value_mb", ("--max-value-mb",), float(values.DEFAULT_MAX_VALUE_MB), group="values", type=float,
           metavar="MB", need="a size in MiB > 0", ok=_size(True),
           help=f"Largest value (pickled) one rank may send back per name (default {values.DEFAULT_MAX_VALUE_MB} "
           "MiB); a larger one fails with its size, the other names still arrive."),
    Option("timeout", ("--timeout",), None, type=float, metavar="SECONDS", need="a number of seconds > 0",
           ok=lambda v: v is None or _size(True)(v),
           help="Wall-clock limit for the cell. At expiry every live rank's Python stack is shown; one-shot "
           "ranks stop, a pool's ranks are interrupted (the pool lives on if they come back)."),
    Option("ranks_output", ("--ranks-output",), "all", choices=("all", "0", "none"),
           help="Whose output (text, displays, progress bars) the cell shows; every rank's text is kept in the "
           "run's logs."),
    Option("prefix", ("--no-prefix",), True, type=bool,
           help="Do not prefix lines with [rankN]:, nor show a line every rank printed alike once as "
           "[rank0-1]: (handy with --ranks-output 0)."),
    Option("max_lines", ("--max-lines",), 200_000, type=int, metavar="N", need="a whole number >= 0", ok=_whole(0),
           help="Lines per rank shown in the cell (default 200000); the rest stays in the rank's log file."),
    Option("max_line_chars", ("--max-line-chars",), 10_000, type=int, metavar="N", need="a whole number >= 1",
           ok=_whole(1), help="Characters of one line shown in the cell (default 10000); a longer line is cut, "
           "with a note; the whole line stays in the rank's log file."),
    Option("max_output_mb", ("--max-output-mb",), 20.0, type=float, metavar="MB", need="a size in MiB >= 0",
           ok=_size(False), help="Text per rank shown in the cell, in MiB (default 20); the rest stays in the "
           "rank's log file."),
    Option("profile", ("--profile",), None, type=_steps, metavar="STEPS", nargs="?", const=5,
           need="a whole number of steps >= 1", ok=lambda v: v is None or _whole(1)(v),
           help="torch.profiler on every rank for STEPS optimizer steps (5 if no number is given), begun after the "
           "first step on every rank. The cell shows each rank's step as compute, communication, waiting for "
           "other ranks, data loading and other, and names the straggler; nbddp.profile() returns the figures "
           "as a DataFrame; each rank's trace (Chrome/Perfetto JSON) is written beside its log. A cell without "
           "an optimizer counts steps with nbddp.rank.profile_session.step()."),
)
BY_NAME = {o.name: o for o in OPTIONS}
POOL_FIXED = tuple(o.name for o in OPTIONS if o.scope == LAUNCH)  # what a running pool cannot change
API = tuple(o.name for o in OPTIONS if o.scope != NAMES)  # nbddp.launch / nbddp.Pool keywords

Config = dataclasses.make_dataclass(
    "Config", [(o.name, object, dataclasses.field(default=o.default)) for o in OPTIONS if o.scope != NAMES],
    kw_only=True, namespace={
        "__doc__": "Every option of a run, with its default (from OPTIONS).",
        "loss_policy": property(lambda conf: ON_LOSS[conf.on_loss],
                                doc="What ``--on-loss`` means (an ``OnLoss``): a pool's, asked once its ranks are up."),
    },
)
Config.__module__ = __name__
DEFAULTS = Config()


def config(options: dict, base=None):
    """A Config from keyword options (``base``'s values for the rest), unknown names refused."""
    if not options:  # a pool's cell without options of its own (no copy: a Config is frozen)
        return base or DEFAULTS
    unknown = sorted(set(options) - set(API))
    if unknown:
        raise UsageError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(API)}.")
    return dataclasses.replace(base or DEFAULTS, **options)


def check(conf) -> None:
    """Every option's own check, then what the platform allows; the first problem is refused."""
    for o in OPTIONS:
        if o.scope != NAMES and (problem := o.check(getattr(conf, o.name))):
            raise UsageError(problem + _fix(o))
    if not hasattr(os, "posix_spawn"):
        raise UsageError(
            f"nbddp runs ranks on Linux and macOS; {sys.platform} has neither fork nor posix_spawn.\n"
            "On Windows, run the notebook inside WSL2 (CUDA and NCCL work there)."
        )
    if conf.start_method == "forkserver" and not (hasattr(os, "pidfd_open") and hasattr(os, "memfd_create")):
        raise UsageError(f"--start-method forkserver needs Linux (pidfds, memfds); {sys.platform} has not: use "
                         "--start-method spawn.")
    if conf.start_method in ("auto", "fork") and not fork_available():
        raise UsageError(
            f"fork is not available on {sys.platform}: use --start-method spawn "
            "(the cell and the globals it uses are shipped with cloudpickle)."
        )


def _fix(o: Option) -> str:
    shown = o.default is not None and o.default is not True and o.default != ()
    return f"\nNothing ran. Default: {o.flag} {o.default}." if shown else "\nNothing ran."


def fork_available() -> bool:
    return hasattr(os, "fork")


def line(conf, scopes=(LAUNCH,)) -> str:
    """``conf``'s options that differ from the defaults, as ``%ddp start`` would take them (``--devices 2 --keep
    10m``)."""
    words = []
    for o in OPTIONS:
        value = getattr(conf, o.name, o.default) if o.scope in scopes else o.default
        if value != o.default:
            words.append(o.flag if o.type is bool else f"{o.flag} {value}")
    return " ".join(words)


def max_value_bytes(conf) -> int:
    return int(conf.max_value_mb * 2**20)


# -- the magics' parser ---------------------------------------------------------------------------------
def argument_specs(scopes=(LAUNCH, CELL, NAMES)):
    """(group title, flags, argparse keywords) per option, in order; defaults are SUPPRESSed so a parse
    holds exactly the options the user gave (``-d3`` and ``--devices=3`` alike)."""
    for o in OPTIONS:
        if o.scope not in scopes:
            continue
        kw = {"dest": o.name, "default": argparse.SUPPRESS, "help": o.help}
        if o.type is bool:
            kw.update(action="store_false" if o.default else "store_true")
        elif o.scope == NAMES and o.nargs:
            kw.update(nargs=o.nargs, metavar=o.metavar)
        else:
            kw.update(type=o.type, metavar=o.metavar)
            if o.nargs == "?":  # the flag alone means its const
                kw.update(nargs="?", const=o.const)
            if o.choices:
                kw["choices"] = o.choices
        yield GROUPS[o.group], o.flags, kw


# shlex's complaints, said as what to fix
QUOTING = {"No closing quotation": "a quotation mark is not closed: close it (--out \"x\"), or quote nothing",
           "No escaped character": "it ends with a backslash, which escapes nothing"}


def parse(line: str) -> dict:
    """The options a ``%%ddp`` line gave, by name, each checked (export reads cells with it too). A line
    that does not parse (bad quoting, an option ``%%ddp`` does not have, a value of the wrong kind) is a
    ``UsageError`` saying what was wrong, before anything runs."""
    import shlex

    from IPython.core.error import UsageError as ArgumentError  # what MagicArgumentParser raises

    if not line.strip():
        return {}
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"bad options `{line.strip()}`: {QUOTING.get(str(e), str(e))}.\nNothing ran.") from None
    try:
        explicit = dict(vars(_parser().parse_args(words)))
    except ArgumentError as e:
        raise UsageError(f"bad options `{line.strip()}`: {e}.\nNothing ran; %%ddp? lists every option.") from None
    for name, value in explicit.items():
        o = BY_NAME[name]
        if o.scope != NAMES and (problem := o.check(value)):
            raise UsageError(problem + _fix(o))
    return explicit


@functools.lru_cache(maxsize=1)
def _parser():
    """Built once: a pool cell's whole budget is a millisecond or two, and building it costs ~0.5 ms."""
    from IPython.core.magic_arguments import MagicArgumentParser

    parser = MagicArgumentParser(prog="%%ddp", add_help=False)
    for _, flags, kw in argument_specs():
        parser.add_argument(*flags, **kw)
    return parser


def split(explicit: dict) -> tuple[dict, dict]:
    """(Config options, names options) of a parse."""
    return ({k: v for k, v in explicit.items() if BY_NAME[k].scope != NAMES},
            {k: v if isinstance(v, bool) else list(v) for k, v in explicit.items() if BY_NAME[k].scope == NAMES})
