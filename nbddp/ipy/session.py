"""What kind of session nbddp runs in, and what that allows (fork, widgets, devices)."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field

from ..hw import nccl, nvml
from ..units import size


@dataclass(frozen=True)
class Environment:
    session: str  # jupyter | colab | kaggle | vscode | ipython-terminal | script
    widgets: bool  # the front end can show ipywidgets
    fork: bool
    fork_note: str
    platform: str
    cpus: int
    gpus: list[str] = field(default_factory=list)
    shm_free_bytes: int | None = None
    nccl: dict[str, str] = field(default_factory=dict)  # what this host needs, set in GPU ranks unless yours
    host_note: str = ""  # what the hosted notebook allows, in a line

    @property
    def accelerator(self) -> str:
        return "cuda" if self.gpus else "cpu"

    def __str__(self) -> str:
        gpus = ", ".join(f"cuda:{i} {n}" for i, n in enumerate(self.gpus)) or "none (NVML sees no GPU)"
        shm = f"{size(self.shm_free_bytes)} free" if self.shm_free_bytes is not None else "n/a"
        return "\n".join([
            f"session:   {self.session} (widgets: {'yes' if self.widgets else 'no'})",
            f"platform:  {self.platform}",
            f"fork:      {'yes' if self.fork else 'no'} - {self.fork_note}",
            f"cpus:      {self.cpus}",
            f"gpus:      {gpus}",
            f"/dev/shm:  {shm}",
            *([f"nccl:      {' '.join(f'{k}={v}' for k, v in self.nccl.items())} (set in GPU ranks unless you set it)"]
              if self.nccl else []),
            *([f"host:      {self.host_note}"] if self.host_note else []),
        ])


HOST_NOTES = {  # what each hosted notebook allows (docs/environments.md says more)
    "colab": "Colab: one GPU at most (--devices auto runs one rank); fork works; the dashboard updates from the "
             "kernel's main thread",
    "kaggle": "Kaggle: up to 2 GPUs (2xT4: --devices 2, NCCL, peer-to-peer off); fork works",
}


def session_kind(env=os.environ, modules=sys.modules, shell=None) -> str:
    """Kaggle first: its image is built from Colab's (google.colab may be there too). Kaggle's kernels carry
    ``KAGGLE_KERNEL_RUN_TYPE``; a ``KAGGLE_USERNAME``/``KAGGLE_KEY`` alone is the Kaggle API on any host."""
    if shell is None:
        shell = running_shell()
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return "kaggle"
    if "google.colab" in modules or "COLAB_RELEASE_TAG" in env:
        return "colab"
    kernel = shell is not None and getattr(shell, "kernel", None) is not None
    if kernel and ("VSCODE_PID" in env or "VSCODE_CWD" in env or env.get("VSCODE_IPC_HOOK_CLI")):
        return "vscode"
    if kernel:
        return "jupyter"
    if shell is not None:
        return "ipython-terminal"
    return "script"


def running_shell():
    """The running IPython shell, or None; never imports IPython (a script, a spawned rank)."""
    getipython = sys.modules.get("IPython.core.getipython")
    return getipython.get_ipython() if getipython else None


def _fork() -> tuple[bool, str]:
    if not hasattr(os, "posix_spawn"):
        return False, f"{sys.platform} is not supported (no fork, no posix_spawn): use WSL2 on Windows"
    if not hasattr(os, "fork"):
        return False, f"{sys.platform} has no fork; use --start-method spawn"
    return True, "ranks are forks of this process: notebook data is shared copy-on-write"


def environment() -> Environment:
    """Report the session kind, fork support and visible devices. Never initialises CUDA."""
    kind = session_kind()
    fork, note = _fork()
    try:
        shm = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm = None
    return Environment(
        session=kind,
        widgets=kind in ("jupyter", "vscode", "colab", "kaggle"),
        fork=fork,
        fork_note=note,
        platform=sys.platform,
        cpus=os.cpu_count() or 1,
        gpus=nvml.backend().names(),
        shm_free_bytes=shm,
        nccl=nccl.host_needs(kind),
        host_note=HOST_NOTES.get(kind, ""),
    )


def kernel_ports() -> tuple:
    """The ports of this IPython kernel's sockets (shell, iopub, stdin, control, heartbeat); () outside a kernel."""
    try:
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return ()
    if not IPKernelApp.initialized():
        return ()
    app = IPKernelApp.instance()
    return tuple(p for p in (app.shell_port, app.iopub_port, app.stdin_port, app.control_port, app.hb_port) if p)
