"""Watching the kernel for the CUDA driver, without ever calling it.

After each cell: is the driver library (``libcuda.so*``) mapped into the kernel (``/proc/self/maps``,
~0.5 ms with torch loaded), and is a driver device (``/dev/nvidia*``) open (``cuInit`` opens
``/dev/nvidiactl``)? Neither proves a CUDA context: torch 2.11's CUDA wheels map the driver on ``import
torch``, and NVML (nbddp's dashboard and free-GPU picking, torch's NVML-based ``is_available``) opens the
same device files as ``cuInit`` (both seen on an H100). So they only *name* the cell; whether a context
exists is decided by the CUDA seam's forked probe. Device files NVML opened through nbddp's seam
(``not_cuda``) are not counted. The first cell where either became true is remembered, with the module
that did it where that can be told: an audit hook sees ``ctypes`` load the driver (numba, the stand-ins, many small
bindings) and, while the driver is not loaded yet, checks at each import whether it has just appeared
(``dlopen(RTLD_NOLOAD)``: never loads anything), which names packages that load it from C. Failing both,
the packages the cell newly imported are the suspects. Linux only (elsewhere there is no CUDA driver).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from dataclasses import dataclass

DRIVER_LIB = "libcuda.so"  # the driver library's file name starts with this (libcuda.so.1, libcuda.so.560.35)
DRIVER_SONAME = "libcuda.so.1"
DEVICE_PREFIXES = ("/dev/nvidia",)  # nvidiactl, nvidia0..N, nvidia-uvm: open once the driver is initialised


@dataclass(frozen=True)
class Sighting:
    """Where the driver first showed up in the kernel."""

    cell: str  # "In [4]", or "before %load_ext nbddp"
    module: str | None  # the Python module that loaded it, when known
    import_line: str | None  # the cell's line importing that module's package, when there is one
    code: str = ""  # the cell's first line, shown when no import line names the culprit
    suspects: tuple[str, ...] = ()  # packages the cell newly imported, when the module is unknown

    def culprit(self) -> str:
        if self.module:
            return f"module {self.module}"
        if len(self.suspects) == 1:
            return f"module {self.suspects[0]}"
        if self.suspects:
            return "one of the modules it imported: " + ", ".join(self.suspects)
        return "the cell's own code"


def driver_mapped(maps: str = "/proc/self/maps") -> str | None:
    """The path of the mapped driver library, or None. Reads the map; touches nothing."""
    try:
        with open(maps, "rb") as f:
            data = f.read()
    except OSError:
        return None
    key = ("/" + DRIVER_LIB).encode()
    at = data.find(key)
    if at < 0:
        return None
    start = data.rfind(b" ", 0, at) + 1
    end = data.find(b"\n", at)
    return data[start:end if end >= 0 else len(data)].decode(errors="replace")


def device_fds(prefixes=DEVICE_PREFIXES) -> dict[int, str]:
    """The driver device files this process holds open, by descriptor."""
    found = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(tuple(prefixes)):
            found[int(fd)] = target
    return found


_not_cuda: dict[int, str] = {}  # descriptors NVML opened (through not_cuda): not a sign of a CUDA context


@contextlib.contextmanager
def not_cuda():
    """Device files opened inside this block are not CUDA's (NVML opens /dev/nvidiactl and /dev/nvidiaN
    too): ``open_devices`` leaves them out while they stay open."""
    prefixes = Watcher.device_prefixes
    before = device_fds(prefixes)
    try:
        yield
    finally:
        _not_cuda.update({fd: t for fd, t in device_fds(prefixes).items() if before.get(fd) != t})


def open_devices(prefixes=DEVICE_PREFIXES) -> list[str]:
    """Driver device files this process holds open, other than NVML's (cheap: only called once the
    library is mapped)."""
    return sorted({t for fd, t in device_fds(prefixes).items() if _not_cuda.get(fd) != t})


def _loaded_now() -> bool:
    """Is the driver library loaded (by its soname)? ``RTLD_NOLOAD``: answers without loading it."""
    import _ctypes

    try:
        handle = _ctypes.dlopen(DRIVER_SONAME, os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    _ctypes.dlclose(handle)
    return True


_SKIP = ("ctypes", "importlib", "nbddp.hw.driverwatch", "_frozen_importlib")


def _loading_module(frame) -> str | None:
    """The innermost module on the stack that is not ctypes, the import machinery or nbddp."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(_SKIP):
            return None if name == "__main__" else name
        frame = frame.f_back
    return None


def _importing_module(frame) -> str | None:
    """The outermost module whose body is running (the one a cell imported), not counting cells."""
    found = None
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "<module>" and not name.startswith(_SKIP) and name != "__main__":
            found = name
        frame = frame.f_back
    return found


class Watcher:
    """Installed once per kernel by the CUDA seam; ``loaded`` and ``initialised`` hold the first sightings."""

    device_prefixes = DEVICE_PREFIXES

    def __init__(self) -> None:
        self.loaded: Sighting | None = None
        self.initialised: Sighting | None = None
        self.library: str | None = None  # path of the mapped driver library
        self.devices: list[str] = []
        self._origin: str | None = None  # module seen loading the driver in this cell ("": the cell's own code)
        self._last_import: str | None = None  # outermost module being imported at the last import event
        self._modules_before: set[str] = set()
        self._in_hook = False
        self._pid = os.getpid()  # forked ranks inherit the hook; only the kernel watches

    def start(self, shell) -> None:
        if self.library is None and (lib := driver_mapped()):
            self.library = lib
            self.loaded = Sighting("before %load_ext nbddp", None, None)
            self.devices = open_devices(self.device_prefixes)
            if self.devices:
                self.initialised = self.loaded
        self._modules_before = set(sys.modules)
        _hook_into_audit(self)
        if shell is not None:
            self.stop(shell)  # %reload_ext: registered once
            shell.events.register("pre_run_cell", self.before_cell)

    def stop(self, shell) -> None:
        """Unregister from the shell (the audit hook stays: Python cannot remove one; it costs a check)."""
        try:
            shell.events.unregister("pre_run_cell", self.before_cell)
        except ValueError:
            pass

    def before_cell(self, info=None) -> None:
        self._modules_before = set(sys.modules)
        self._origin = self._last_import = None

    def after_cell(self, cell: str, source: str) -> None:
        """Called by the CUDA seam after each cell (post_run_cell) with the cell's name and source."""
        if self.initialised is not None:
            return
        lib = self.library or driver_mapped()
        if lib is None:
            return
        if self.loaded is None:
            self.library = lib
            self.loaded = self._sighting(cell, source)
        self.devices = open_devices(self.device_prefixes)
        if self.devices:
            self.initialised = self.loaded if self.loaded.cell == cell else self._sighting(cell, source)

    def no_context(self) -> None:
        """The probe found no CUDA context: the device files open now are someone's NVML, not CUDA's.
        Forget them, so a later ``cuInit`` is named by its own cell."""
        _not_cuda.update(device_fds(self.device_prefixes))
        self.initialised, self.devices = None, []

    def _sighting(self, cell: str, source: str) -> Sighting:
        # No event after the load: the cell's last import did it.
        module = (self._origin if self._origin is not None else self._last_import) or None
        new = sorted({m.split(".")[0] for m in set(sys.modules) - self._modules_before} - set(sys.builtin_module_names))
        new = [m for m in new if not m.startswith("_") and m not in sys.stdlib_module_names and m != "nbddp"]
        top = module.split(".")[0] if module else (new[0] if len(new) == 1 else None)
        first = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
        return Sighting(cell, module, _import_line(source, top) if top else None, first,
                        () if module else tuple(new[:6]))

    # -- audit hook: runs on every audited event in the process, so it returns at once for most ------
    def audit(self, event: str, args) -> None:
        if self._in_hook or self.library is not None or self._origin is not None or os.getpid() != self._pid:
            return
        if threading.current_thread().name == WARM_THREAD:  # nbddp's own imports (kernel/ranks/warm.py), not the cell's
            return
        if event == "ctypes.dlopen":
            name = args[0] if args else None
            if isinstance(name, (str, bytes)) and os.fsdecode(name).rsplit("/", 1)[-1].startswith(DRIVER_LIB):
                self._origin = _loading_module(sys._getframe(1)) or ""  # "": the cell itself called ctypes
        elif event == "import":  # only imports of modules not loaded yet: a few per cell once warm
            self._in_hook = True
            try:
                if _loaded_now():
                    # Loaded since the previous import began: by the module imported then, or by the one
                    # importing it (the outermost import in progress is what the cell imported).
                    self._origin = self._last_import
                else:
                    self._last_import = _importing_module(sys._getframe(1)) or str(args[0])
            finally:
                self._in_hook = False


_watchers: list[Watcher] = []  # audit hooks cannot be removed: one hook, forwarding to the current watcher


WATCHED = frozenset({"import", "ctypes.dlopen"})  # the audit events a watcher looks at
WARM_THREAD = "nbddp-warm"  # the thread kernel/ranks/warm.py imports on: its imports are not the cell's


def _audit(event: str, args) -> None:
    # every compile, exec, pickle and os call in the process passes here (a pool cell's too): most return at
    # once; a forked rank (or a worker it forked) has no watcher
    if event not in WATCHED or not _watchers:
        return
    try:
        _watchers[-1].audit(event, args)
    except Exception:  # noqa: BLE001 - an audit hook that raises aborts the audited operation (an import, an open...)
        pass


def _hook_into_audit(watcher: Watcher) -> None:
    if not _watchers:
        _watchers.append(watcher)
        sys.addaudithook(_audit)
        os.register_at_fork(after_in_child=_watchers.clear)
    else:
        _watchers[-1] = watcher


def _import_line(source: str, package: str) -> str | None:
    pat = re.compile(rf"^\s*(import\s+{re.escape(package)}\b.*|from\s+{re.escape(package)}[\s.].*)$")
    for line in source.splitlines():
        if pat.match(line):
            return line.strip()
    return None
