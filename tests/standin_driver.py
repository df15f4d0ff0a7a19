"""A stand-in CUDA driver for tests on machines without a GPU: a tiny shared object named like the driver
(soname libcuda.so.1), built with gcc, and stand-in "libraries" that load it the ways real ones do.

Its ``cuInit`` behaves like the driver's where it matters to nbddp: in the process that initialised it, it
opens a "device file" (``$STANDIN_CTL``, named like /dev/nvidiactl; unset: none, like a driver that opened
its devices elsewhere); in a fork of that process it fails with 3 (CUDA_ERROR_NOT_INITIALIZED).
"""
from __future__ import annotations

import os
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

DRIVER_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
static int init_pid;
int cuInit(unsigned flags) {
    if (init_pid && init_pid != getpid()) return 3;  /* a fork of an initialised process */
    if (!init_pid) {
        const char *ctl = getenv("STANDIN_CTL");
        init_pid = getpid();
        if (ctl) open(ctl, O_RDWR | O_CREAT, 0600);  /* held open, like /dev/nvidiactl */
    }
    return 0;
}
int standin_initialised(void) { return init_pid == getpid(); }
"""

NATIVE_C = r"""
int cuInit(unsigned flags);
int native_init(void) { return cuInit(0); }
"""

LIBRARIES = {
    # loads the driver with ctypes and initialises it on import (like numba.cuda, pycuda.autoinit)
    "gpulib_ctypes.py": """
        import ctypes, os
        driver = ctypes.CDLL(os.environ["STANDIN_DRIVER"])
        driver.cuInit(0)
    """,
    # a native extension linked against the driver (DT_NEEDED libcuda.so.1): the driver arrives from C
    "gpulib_native/__init__.py": """
        from . import _native
        _native.lib.native_init()
        from . import util
    """,
    "gpulib_native/_native.py": """
        import ctypes, os
        lib = ctypes.CDLL(os.environ["STANDIN_NATIVE"])
    """,
    "gpulib_native/util.py": "",
    # loads the driver on import, initialises it only when asked (like cupy)
    "gpulib_lazy.py": """
        import ctypes, os
        driver = ctypes.CDLL(os.environ["STANDIN_DRIVER"])
        def init():
            return driver.cuInit(0)
        def initialised():
            return bool(driver.standin_initialised())
    """,
    # asks torch for CUDA on import (like bitsandbytes): torch's lazy init, called from a library
    "gpulib_torch.py": """
        import torch
        try:
            torch.cuda._lazy_init()
        except (AssertionError, RuntimeError):  # a CPU build of torch: the attempt is what counts
            pass
    """,
}


@dataclass
class StandIn:
    root: Path
    driver: Path  # .../driver/libcuda.so.1
    devdir: Path  # where the stand-in "device files" are opened

    def env(self, *, device_file: bool = True) -> dict:
        path = [p for p in (os.environ.get("PYTHONPATH"), str(self.root / "site")) if p]
        env = {
            "STANDIN_DRIVER": str(self.driver),
            "STANDIN_NATIVE": str(self.root / "libgpunative.so"),
            "PYTHONPATH": os.pathsep.join(path),  # the stand-in libraries importable in the kernel
        }
        if device_file:
            env["STANDIN_CTL"] = str(self.devdir / "nvidiactl")
        return env


def build(root: Path) -> StandIn:
    root = Path(root)
    drv = root / "driver"
    drv.mkdir(parents=True, exist_ok=True)
    (root / "dev").mkdir(exist_ok=True)
    (root / "driver.c").write_text(DRIVER_C)
    (root / "native.c").write_text(NATIVE_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(drv / "libcuda.so.1"),
                    str(root / "driver.c")], check=True, timeout=60)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(root / "libgpunative.so"), str(root / "native.c"),
                    f"-L{drv}", "-l:libcuda.so.1", f"-Wl,-rpath,{drv}"], check=True, timeout=60)
    for name, code in LIBRARIES.items():
        path = root / "site" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code).lstrip())
    return StandIn(root, drv / "libcuda.so.1", root / "dev")
