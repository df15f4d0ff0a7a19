"""In a rank: its debugger for JupyterLab's debugger panel (the kernel's side: kernel/debugger/rankdebug.py).

While the panel is on, each cell's command carries where the kernel's debugpy adapter listens
(``RunCell.debug``, loopback only, with debugpy's access token); the rank connects to it (``before_cell``)
and waits until the kernel's panel has given it the breakpoints set; it lets go at the cell's end
(``after_cell``): ``breakpoint()`` is pdb's again. Ranks are started with posix's own fork and spawn, not
debugpy's replacements of them; a forked rank first lets go of the kernel's debugger it inherited
(``after_fork``)."""
from __future__ import annotations

import importlib
import os
import sys
import threading
from types import SimpleNamespace

# what nbddp uses of pydevd's private modules (debugpy's vendored pydevd): (module, names, what for). Checked
# once per process (``parts``): where one is missing, the debugger panel sees the kernel only
# (kernel/debugger/rankdebug.py
# says why at %load_ext) and every rank starts and runs as without the panel.
REQUIRED = (
    ("pydevd", ("settrace", "settrace_forked", "stoptrace", "install_breakpointhook"), "a rank's debugger"),
    ("_pydevd_bundle.pydevd_constants", ("get_global_debugger", "GlobalDebuggerHolder"), "the rank's debugger object"),
    ("pydevd_tracing", ("restore_sys_set_trace_func",), "a forked rank's tracing undone"),
    ("_pydev_bundle.pydev_monkey", ("undo_patch_thread_modules",), "a forked rank's threading undone"),
)
MONITORING = ("_pydevd_sys_monitoring.pydevd_sys_monitoring", ("stop_monitoring",),
              "a forked rank's sys.monitoring undone")

_gate: list = []  # [(parts or None, why or None)], once checked in this process (a fork inherits the kernel's)


def parts():
    """pydevd's parts nbddp uses (``REQUIRED``, as attributes), or None where this debugpy lacks one."""
    if not _gate:
        _gate.append(_check())
    return _gate[0][0]


def unsupported() -> str | None:
    """Why the ranks' debugger cannot be used with this debugpy, or None."""
    parts()
    return _gate[0][1]


def _check() -> tuple:
    try:
        import debugpy
        import debugpy.server.api  # puts debugpy's own pydevd on the path
    except Exception as e:  # noqa: BLE001 - no debugpy, or one that does not import
        return None, f"nbddp: the debugger panel cannot reach the ranks: debugpy does not import ({e!r})."
    found = {}
    constants = None
    for module, names, what in REQUIRED:
        try:
            mod = importlib.import_module(module)
        except (ImportError, AttributeError):  # renamed or gone in this debugpy
            return None, _why(debugpy, f"no module {module}", what)
        for name in names:
            if not hasattr(mod, name):
                return None, _why(debugpy, f"no {module}.{name}", what)
            found[name] = getattr(mod, name)
        if module == "_pydevd_bundle.pydevd_constants":
            constants = mod
    found["monitoring"] = bool(getattr(constants, "PYDEVD_USE_SYS_MONITORING", False))
    if found["monitoring"]:
        module, (name,), what = MONITORING
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # renamed or gone in this debugpy
            return None, _why(debugpy, f"no {module}.{name}", what)
    return SimpleNamespace(**found), None


def _why(debugpy, missing: str, what: str) -> str:
    return (f"nbddp: the debugger panel cannot reach the ranks with debugpy {getattr(debugpy, '__version__', '?')}: "
            f"its pydevd has {missing} ({what}). The panel works in the kernel as usual; pdb works in the ranks "
            "(breakpoint(), %ddp debug).")


def _debugger():
    """The rank's own connected debugger (pydevd's), or None: one inherited from the kernel by a fork
    debugpy did not see is not connected (its threads stayed in the kernel)."""
    if sys.modules.get("pydevd") is None or parts() is None:
        return None
    db = parts().get_global_debugger()
    writer = getattr(db, "writer", None)
    return db if writer is not None and writer.is_alive() else None


def after_fork() -> None:
    """In a rank just forked: a debugger the kernel ran (on the forking thread: it traces the rank's too)
    is let go, as debugpy's own fork hook does for a child it does not debug; the rank connects at its
    cell while the panel is on."""
    if sys.modules.get("pydevd") is None:
        return
    pydevd = parts()
    if pydevd is None:  # (a debugpy whose pydevd nbddp cannot reach: the rank runs on as it is)
        return
    if pydevd.GlobalDebuggerHolder.global_dbg is not None:
        pydevd.settrace_forked(setup_tracing=False)  # the kernel's debugger object, its threads: gone here
        _untrace()


def _untrace() -> None:
    """No tracing left of pydevd's here: pydevd.stoptrace's own steps but for its flush of sys.stdout (the
    kernel's stream, whose lock the kernel's IO thread may have held at the fork)."""
    pydevd = parts()
    pydevd.restore_sys_set_trace_func()
    if pydevd.monitoring:
        pydevd.stop_monitoring(all_threads=True)
    else:
        sys.settrace(None)
        threading.settrace(None)
    pydevd.undo_patch_thread_modules()


def before_cell(setup: dict | None) -> None:
    """While the panel is on (``setup``): connected for this cell (``after_cell`` lets go)."""
    if setup is None or parts() is None:  # (the kernel sends no setup then: the panel sees the kernel only)
        return
    _forget()  # (a debugger whose connection died: nothing of it left)
    connect(setup)
    parts().install_breakpointhook()  # breakpoint() stops in the panel (rank/debug.py gave it to pdb at the start)


def after_cell() -> None:
    """The cell over: a pool's rank lets go of the panel, to connect anew at its next cell. No connection of a
    rank outlives its cell, so none outlives a panel session: debugpy's adapter (1.8) announces a connection it
    holds to the panel's next session, whose attach the rank's pydevd answers ``terminated``, and refuses the
    rank's own new connection while it holds the old one ("already connected": the rank would wait forever)."""
    try:
        if _debugger() is not None:
            disconnect()
    except Exception:  # noqa: BLE001 - a connection already gone: the next cell connects anew all the same
        _forget()


def _forget() -> None:
    """A debugger object whose connection is gone (or none): nothing of it left, for a new one."""
    if sys.modules.get("pydevd") is None:
        return
    holder = parts().GlobalDebuggerHolder
    if holder.global_dbg is not None:
        _untrace()
        holder.global_dbg = None


def connect(setup: dict) -> None:
    """Connect to the kernel's debugpy adapter and wait until the panel let the rank run (breakpoints set)."""
    import debugpy

    pydevd = parts()
    # a rank forked from a background cell's thread runs on a copy of it, a daemon thread: pydevd would take
    # the program for ended (no user thread left that is not a daemon) and end the session at once
    setattr(threading.current_thread(), "__pydevd_main_thread", True)
    if threading.current_thread() is threading.main_thread():
        threading.current_thread().name = "MainThread"  # (a copy of the background thread is named for it)
    # the adapter gives a process to the kernel's debugger as its subprocess by the parent pid it reports: a
    # forkserver's rank reports the kernel's (its own parent is the server, which the adapter does not know)
    parent = {"ppid": setup["kernel_pid"]} if setup.get("kernel_pid") and "ppid" in _settrace_parameters(pydevd) else {}
    pydevd.settrace(host=setup["host"], port=int(setup["port"]), suspend=False, trace_only_current_thread=False,
                    overwrite_prev_trace=True, patch_multiprocessing=False, access_token=setup.get("access_token"),
                    client_access_token=setup.get("client_access_token"), notify_stdin=False,
                    wait_for_ready_to_run=True, block_until_connected=True,
                    dont_trace_start_patterns=(os.path.dirname(debugpy.__file__),),
                    dont_trace_end_patterns=("debugpy_launcher.py",), **parent)


def _settrace_parameters(pydevd) -> set:
    import inspect

    try:
        return set(inspect.signature(pydevd.settrace).parameters)
    except (TypeError, ValueError):
        return set()


def disconnect() -> None:
    """The panel is off: the rank's debugger gone, ``breakpoint()`` pdb's again (rank/debug.py)."""
    pydevd = parts()
    pydevd.stoptrace()
    pydevd.GlobalDebuggerHolder.global_dbg = None  # a later connect makes a new one
    sys.breakpointhook = sys.__breakpointhook__


def rich(value) -> tuple[dict, dict]:
    """A value's MIME bundle as the notebook would show it (JupyterLab's rich variable view)."""
    try:
        from IPython.core.interactiveshell import InteractiveShell

        if InteractiveShell.initialized():
            return InteractiveShell.instance().display_formatter.format(value)
    except Exception:  # noqa: BLE001 - a formatter's failure: plain text instead
        pass
    return {"text/plain": repr(value)}, {}
