"""Inside a rank: cut what the fork inherited from the Jupyter kernel that must not be used there.

A forked rank holds copies of the kernel's zmq sockets and of objects that write to them (ipykernel's
``OutStream``, the display publisher, widget comms, ``tqdm.auto``'s widget bar). Using them from a
child corrupts or slows the kernel's channels, so each is pointed at the rank's own stdout/stderr.
A rank is also not an interactive session: libraries that refuse to run DDP "in a notebook"
(Lightning reads ``sys.ps1`` at import) must see a script.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import itertools
import os
import sys

from ..ipy.session import running_shell

# -- modules a rank patches, found before the fork -----------------------------------------------------
# Walking sys.modules in a fresh fork writes every module object's reference count: one copy-on-write
# fault per page, ~13 ms a rank with Lightning imported (measured). The process that forks the ranks (the
# kernel, a Ray agent) finds them instead, where the walk faults nothing, once per set of modules.
LIGHTNING = ("lightning", "pytorch_lightning")
LAUNCHER_LIBS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers")
LAUNCHER_NAMES = ("spawn", "start_processes")  # torch.multiprocessing's
_found: dict = {"key": None}


def _modules_key() -> tuple:
    return len(sys.modules), next(reversed(sys.modules), None)  # modules are added at the end


def before_fork() -> None:
    """In the process about to fork ranks: which modules their patches touch (kept while no module is added)."""
    key = _modules_key()
    if _found["key"] != key:
        _found.update(_scan(), key=key)


def _scan() -> dict:
    mp = sys.modules.get("torch.multiprocessing")
    launchers = {id(getattr(mp, n)) for n in LAUNCHER_NAMES} if mp is not None else set()
    interactive, bound = [], []
    for name, mod in list(sys.modules.items()):
        if name.startswith(LIGHTNING) and getattr(mod, "_IS_INTERACTIVE", False):
            interactive.append(name)
        if name.startswith(LAUNCHER_LIBS) and isinstance(d := getattr(mod, "__dict__", None), dict):
            bound += [(name, attr) for attr in LAUNCHER_NAMES if id(d.get(attr)) in launchers]
    return {"interactive": interactive, "launchers": bound}


def found(kind: str) -> list:
    """In a rank: ``interactive``, the names of Lightning's modules that read ``sys.ps1`` at import;
    ``launchers``, the (module, name) pairs a library bound to torch.multiprocessing's ``spawn`` or
    ``start_processes`` (ask before patching them). As found before the fork; a rank that imported a
    module since (or was spawned) walks its own."""
    found = _found if _found["key"] == _modules_key() else _scan()
    return found[kind]


def redirect_in_rank(kernel_streams=(), chan=None) -> None:
    """``kernel_streams``: what sys.stdout/sys.stderr were in the kernel at fork time; ``chan``: the
    rank's channel, which carries its rich outputs (display, plots) to the cell."""
    _redirect_outstreams(kernel_streams)
    _shell_for_displays(chan)
    _rank_display(chan)
    _rank_pager()
    _dummy_comms()
    _console_tqdm(chan)
    _not_interactive()


def _redirect_outstreams(kernel_streams) -> None:
    """Anything still holding the kernel's OutStream (a logging handler made in the notebook, say)."""
    iostream = sys.modules.get("ipykernel.iostream")
    if iostream is None:
        return

    def _target(stream):
        return sys.stderr if getattr(stream, "name", "stdout") == "stderr" else sys.stdout

    iostream.OutStream.write = lambda self, s: _target(self).write(s)
    iostream.OutStream.writelines = lambda self, lines: _target(self).writelines(lines)
    iostream.OutStream.flush = lambda self: _target(self).flush()
    for stream in kernel_streams:  # ipykernel >= 7 also binds write on each instance
        if isinstance(stream, iostream.OutStream):
            target = _target(stream)
            stream.__dict__.update(write=target.write, writelines=target.writelines, flush=target.flush)


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"  # a model only the rank has: never sent


SHELL_IMPORTS = ("IPython.core.interactiveshell", "traitlets.config")  # ~0.12 s: warm them where ranks fork


def _shell_for_displays(chan) -> None:
    """A rank outside any IPython shell (spawned, or forked on another node by a Ray agent): there
    IPython's ``display()`` only prints ``repr``. A quiet shell of its own (no history file) gives it the
    formatter, so rich output reaches the cell as from a rank forked from the kernel."""
    if chan is None or running_shell() is not None:
        return
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config
    except ImportError:  # no IPython here: display() is not there either
        return
    config = Config()
    config.HistoryManager.enabled = False
    InteractiveShell.instance(config=config)


def _rank_display(chan) -> None:
    """``display(obj)``, ``plt.show()``, rich reprs: their MIME bundles go to the cell through the
    rank's channel instead of the kernel's zmq sockets. Text written before a display is flushed first,
    so the cell shows both in the order the rank produced them."""
    shell = running_shell()
    if shell is None or chan is None:
        return
    from ..wire.messages import ClearOutput, Display

    def flush():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()

    def publish(data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        data = {k: v for k, v in (data or {}).items() if k != WIDGET_VIEW}
        if not data:
            return
        flush()
        chan.send(Display(data, metadata or {}, (transient or {}).get("display_id"), update))

    def clear_output(wait=False):
        flush()
        chan.send(ClearOutput(wait))

    shell.display_pub.publish = publish
    shell.display_pub.clear_output = clear_output


def _rank_pager() -> None:
    """``obj?``, ``obj??``, ``%pinfo``, ``%pdoc``...: IPython pages their text, and ipykernel's pager
    sends it as a payload of the execute_reply, which a rank never sends. The text goes to the rank's
    stdout instead, so it appears in the cell (rank-prefixed, like any output)."""
    shell = running_shell()
    if shell is None:
        return

    def show_in_pager(self, data, start=0, screen_lines=0, **kwargs):
        text = data.get("text/plain", "") if isinstance(data, dict) else str(data)
        print("\n".join(text.splitlines()[start:]))

    shell.set_hook("show_in_pager", show_in_pager, priority=0)  # before ipykernel's payload pager (99)


def _dummy_comms() -> None:
    comm = sys.modules.get("comm")
    if comm is not None and hasattr(comm, "DummyComm"):
        comm.create_comm = lambda *a, **k: comm.DummyComm(*a, **k)
    # ipywidgets 7 (and 8 on ipykernel < 6.18, which has no comm package integration) open ipykernel's
    # own Comm: in a rank it may be made, never sent (it would write on the kernel's iopub socket)
    kernel_comm = getattr(sys.modules.get("ipykernel.comm"), "Comm", None)
    for send in ("_publish_msg", "publish_msg"):
        if hasattr(kernel_comm, send):
            setattr(kernel_comm, send, lambda self, *a, **k: None)


def _console_tqdm(chan=None) -> None:
    """tqdm's bars in a rank travel as records (``_recorded_bars``: a widget bar would need the kernel's
    sockets; its updates never reach the cell). ``tqdm.auto`` picks ``tqdm.std``; and ``tqdm.notebook``'s
    widget class, even as a name the notebook bound before the cell (``from tqdm.auto import tqdm``), behaves
    as ``tqdm.std``'s does. Whatever of tqdm the rank imports later gets the same treatment."""
    std = sys.modules.get("tqdm.std")
    if std is not None:
        _fresh_tqdm_state(std)
        _recorded_bars(std, chan)
    notebook = sys.modules.get("tqdm.notebook")
    if notebook is not None:
        _text_bars(notebook)
    auto = sys.modules.get("tqdm.autonotebook")
    if auto is not None:  # (it imported tqdm.std)
        for mod in (auto, sys.modules.get("tqdm.auto")):
            if mod is not None:
                mod.tqdm, mod.trange = std.tqdm, std.trange
    later = {"tqdm.std", "tqdm.autonotebook", "tqdm.notebook"} - set(sys.modules)
    if later:
        sys.meta_path.insert(0, _ConsoleTqdm(later, chan))


NOTEBOOK_ONLY = ("display",)  # tqdm.notebook's own keywords, which tqdm.std refuses


def _text_bars(notebook) -> None:
    """``tqdm.notebook.tqdm`` and its subclasses (``tqdm.auto.tqdm``) behave as ``tqdm.std.tqdm``: the
    class's own methods go (status_printer, display, __init__, ...), so tqdm.std's are found instead."""
    cls = notebook.tqdm_notebook
    for name in [n for n in vars(cls) if not n.startswith("__") or n in ("__init__", "__iter__")]:
        delattr(cls, name)

    def __init__(self, *args, **kwargs):
        for key in NOTEBOOK_ONLY:
            kwargs.pop(key, None)
        super(cls, self).__init__(*args, **kwargs)

    cls.__init__ = __init__


class _Unwritten:
    """Where a bar that travels as records writes while tqdm closes it (its last newline): nowhere."""

    def write(self, s):
        return len(s)

    def flush(self):
        pass


PLAIN = (str, int, float, bool, type(None))


def _recorded_bars(std, chan) -> None:
    """``tqdm.std.tqdm`` (and every class drawing through it) sends each redraw of a bar on the rank's
    stdout or stderr as a ``messages.Progress`` on the channel, when tqdm would draw it (its rate limits
    stay), and writes nothing of it to the stream: the kernel draws it, and the rank's log keeps its text.
    A bar on another file, or in a process the rank forked (a DataLoader worker), draws as text there."""
    if chan is None:
        return
    from ..wire.messages import Progress
    from .stdio import flush_streams

    cls, rank_pid, numbers = std.tqdm, os.getpid(), itertools.count()
    display, clear, close = cls.display, cls.clear, cls.close
    outstream = getattr(sys.modules.get("ipykernel.iostream"), "OutStream", ())  # the kernel's, redirected

    def recorded(bar) -> str | None:
        """The stream a bar of the rank's draws on ("stdout", "stderr"), None for another file."""
        if "_nbddp_stream" not in bar.__dict__:
            fp = getattr(bar, "fp", None)
            fp = getattr(fp, "_wrapped", fp)  # (tqdm wraps the file it is given)
            stream = "stdout" if fp is sys.stdout else "stderr" if fp is sys.stderr else None
            if stream is None and outstream and isinstance(fp, outstream):
                stream = "stderr" if getattr(fp, "name", "") == "stderr" else "stdout"
            bar.__dict__["_nbddp_stream"] = stream
        return bar.__dict__["_nbddp_stream"] if os.getpid() == rank_pid else None

    def send(bar, closed=False, leave=True) -> None:
        number = bar.__dict__.get("_nbddp_bar")
        if number is None:
            number = bar.__dict__["_nbddp_bar"] = next(numbers)
        meter = bar.format_dict
        state = {k: v for k, v in meter.items() if isinstance(v, PLAIN)}
        line = bar.format_meter(**meter)
        flush_streams()  # the text written before it comes first
        chan.send(Progress(number, state, line, closed, leave, recorded(bar)))

    def draw(self, msg=None, pos=None):
        if not recorded(self):
            return display(self, msg, pos)
        if self.disable:  # close() draws the last state (leave) or clears it (msg "")
            send(self, closed=True, leave=msg is None)
        elif msg is None:
            send(self)
        return True

    def clear_bar(self, nolock=False):
        if not recorded(self):
            clear(self, nolock)

    def close_bar(self):
        if not recorded(self):
            return close(self)
        fp, self.fp = self.fp, _Unwritten()
        try:
            return close(self)
        finally:
            self.fp = fp

    cls.display, cls.clear, cls.close = draw, clear_bar, close_bar


def _fresh_tqdm_state(std) -> None:
    """Bars the kernel made are not the rank's: its own start at the top line, and its lock is its own
    (the kernel's holds a semaphore shared with every fork, which a rank killed mid-draw would leave
    taken, and a thread lock another kernel thread may have held at the fork)."""
    std.tqdm._instances.clear()
    lock = std.TqdmDefaultWriteLock
    lock.th_lock = std.TRLock()
    if "mp_lock" in vars(lock):
        del lock.mp_lock  # made again, the rank's own, when a bar needs it
    pending = [std.tqdm]
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "_lock" in vars(cls):
            del cls._lock


class _ConsoleTqdm(importlib.abc.MetaPathFinder):
    """tqdm imported in the rank: ``tqdm.std`` with its bars sent as records, ``tqdm.autonotebook`` as if no
    kernel were present (it then picks tqdm.std), ``tqdm.notebook`` behaving as tqdm.std."""

    def __init__(self, names: set, chan=None):
        self.names, self.chan = names, chan

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        self.names.discard(name)
        if not self.names:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            if name == "tqdm.std":
                spec.loader = _RecordedBarsLoader(spec.loader, self.chan)
            else:
                spec.loader = (_HideKernel if name == "tqdm.autonotebook" else _TextBarsLoader)(spec.loader)
        return spec


class _HideKernel(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    # what tqdm.autonotebook looks at to pick the widget bar: ipykernel.zmqshell imported (tqdm 4.70),
    # get_ipython().config naming IPKernelApp (tqdm 4.67): with neither, it picks tqdm.std
    HIDDEN = ("ipykernel.zmqshell", "IPython")

    def exec_module(self, module):
        hidden = {name: sys.modules.pop(name) for name in self.HIDDEN if name in sys.modules}
        try:
            self._loader.exec_module(module)
        finally:
            sys.modules.update(hidden)


class _TextBarsLoader(_HideKernel):
    def exec_module(self, module):
        self._loader.exec_module(module)
        _text_bars(module)


class _RecordedBarsLoader(_HideKernel):
    def __init__(self, loader, chan):
        super().__init__(loader)
        self.chan = chan

    def exec_module(self, module):
        self._loader.exec_module(module)
        _recorded_bars(module, self.chan)


def _not_interactive() -> None:
    for attr in ("ps1", "ps2"):
        if hasattr(sys, attr):
            delattr(sys, attr)
    if not any(m in sys.modules for m in ("lightning", "lightning_fabric", "pytorch_lightning")):
        return
    for name in found("interactive"):
        sys.modules[name]._IS_INTERACTIVE = False
