"""What a rank does, from the instant after fork (or spawn) until ``os._exit``.

Order matters and is the point of this module: first cut every tie to the kernel (die with it,
ignore its SIGINT, own stdout/stderr, never touch its zmq sockets), then make torch safe after a fork
(thread count before any op), then join the process group, run the job, send the result, leave.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import gc
import io
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

from . import kernelside, results, usergroup  # issue10: kernelside, usergroup

PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)  # this process's C library: prctl, setvbuf, fflush
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class RankSpec:
    rank: int
    world_size: int
    accelerator: str  # "cuda" | "cpu"
    backend: str  # "nccl" | "gloo"
    device_id: int | None
    threads: int
    store_path: str
    parent_pid: int
    env: dict = field(default_factory=dict)
    pg_timeout_s: float = 1800.0


@dataclass(frozen=True)
class RankContext:
    """What a job sees: the same names the cell gets."""

    rank: int
    local_rank: int
    world_size: int
    device: object  # torch.device


def fork_main(spec: RankSpec, job, *, out_fd: int, err_fd: int, result_fd: int, close_fds) -> None:
    """Entry point in a freshly forked child. Never returns."""
    code = 70
    try:
        # Objects inherited from the kernel are never collected here: the GC skips them (a big
        # notebook heap would slow every collection) and leaves their pages shared with the kernel.
        gc.freeze()
        _tie_to_parent(spec.parent_pid)
        for fd in close_fds:
            _close(fd)
        _own_stdio(out_fd, err_fd)
        code = run_rank(spec, job, result_fd)
    finally:
        _leave(code)


def run_rank(spec: RankSpec, job, result_fd: int) -> int:
    """Set up torch and the process group, run ``job(ctx)``, send its result. Returns the exit code."""
    _detach_from_kernel()
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    os.environ.update(spec.env)

    import torch  # the first thing to touch torch: thread count, before any op (OpenMP fork hazard)

    torch.set_num_threads(spec.threads)
    message, code = _run_job(spec, job, torch, result_fd)
    _send(result_fd, message)
    return code


READY = b"\x01"  # sent on the result pipe once the process group is up: the rank is "running"


def _run_job(spec: RankSpec, job, torch, result_fd: int) -> tuple[bytes, int]:
    """Returns the pickled message for the parent (pickled once: results can be large) and the exit code."""
    import torch.distributed as dist

    try:
        if spec.accelerator == "cuda":
            from . import cuda

            device = cuda.backend().set_device(spec.device_id)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            spec.backend,
            store=dist.FileStore(spec.store_path, spec.world_size),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
        )
        kernelside.after_process_group()  # issue10: user's init/destroy, launchers in a rank, guardian
        os.write(result_fd, READY)
        value = job(RankContext(spec.rank, spec.rank, spec.world_size, device))
        _leave_group(spec)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 0:
            return results.dumps({"ok": True, "value": None}), 0
        return results.dumps({"ok": False, "kind": "exit", "code": code, "time": time.time()}), code
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        return results.dumps(_error_message(e)), 1
    try:
        return results.dumps({"ok": True, "value": value}), 0
    except Exception as e:  # noqa: BLE001
        failed = {"ok": False, "kind": "result", "type": results.describe(value),
                  "message": f"{type(e).__name__}: {e}", "time": time.time()}
        return results.dumps(failed), 1


def _leave_group(spec: RankSpec) -> None:
    """After a successful job. NCCL: finish the GPU's queued work, then tear the communicators down.
    gloo: a barrier proves every rank is past its last collective; os._exit then frees the rest
    (destroy_process_group would add ~20 ms of FileStore polling to every run, measured)."""
    import torch.distributed as dist

    if not usergroup.group_alive():  # issue10: the cell destroyed the group itself, as torchrun scripts do
        return
    if spec.accelerator == "cuda":
        from . import cuda

        cuda.backend().synchronize()
        dist.destroy_process_group()
    else:
        dist.barrier()


def _error_message(exc: BaseException) -> dict:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PKG_DIR):
        tb = tb.tb_next  # hide nbddp's own frames: the traceback starts in the user's code
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {
        "ok": False,
        "kind": "exception",
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": text,
        "time": time.time(),
    }


def _send(fd: int, payload: bytes) -> None:
    data = results.frame(payload)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.close(fd)


# -- ties to the parent ---------------------------------------------------------------------------
def _tie_to_parent(parent_pid: int) -> None:
    """Die with the kernel, ignore Jupyter's group-wide SIGINT, get a process group of our own."""
    if sys.platform.startswith("linux"):
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.setpgid(0, 0)  # teardown signals the rank and its own children (DataLoader workers) together
    except OSError:
        pass


def _own_stdio(out_fd: int, err_fd: int) -> None:
    """fd 1/2 become our pipes (C extensions and subprocesses included); stdin is /dev/null."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in (out_fd, err_fd, null):
        if fd > 2:
            _close(fd)


def _detach_from_kernel() -> None:
    """New Python streams on fd 1/2, and nothing left that could write to the kernel's zmq sockets."""
    kernel_streams = (sys.stdout, sys.stderr)
    sys.stdout = sys.__stdout__ = _stream(1, line_buffering=False)
    sys.stderr = sys.__stderr__ = _stream(2, line_buffering=True)
    sys.stdin = sys.__stdin__ = open(os.devnull)  # noqa: SIM115
    _start_flusher()
    os.register_at_fork(after_in_child=_start_flusher)  # DataLoader workers forked by the rank
    _line_buffer_c_stdout()
    from . import kernelside

    kernelside.redirect_in_rank(kernel_streams)


def _stream(fd: int, line_buffering: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(io.BufferedWriter(raw, 1 << 16), encoding="utf-8", errors="backslashreplace",
                            line_buffering=line_buffering)


FLUSH_S = 0.05


def _start_flusher() -> None:
    """stdout is block-buffered (one write per 64 KiB, not per line: a chatty rank costs its parent
    and its own loop far less); this thread pushes what is pending every 50 ms, so output stays live.
    stderr stays line-buffered: warnings and errors go out at once."""
    import threading

    def flush_forever():
        while True:
            time.sleep(FLUSH_S)
            try:
                sys.stdout.flush()
            except Exception:  # a closed or replaced stream: nothing to push
                pass

    threading.Thread(target=flush_forever, name="nbddp-flush", daemon=True).start()


def _line_buffer_c_stdout() -> None:
    try:
        for name in ("stdout", "stderr"):
            LIBC.setvbuf(ctypes.c_void_p.in_dll(LIBC, name), None, 1, 0)  # _IOLBF
    except (OSError, ValueError, AttributeError):
        pass


def _leave(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        LIBC.fflush(None)
    except Exception:
        pass
    os._exit(code)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
