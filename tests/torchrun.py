"""Real torchrun, as a user runs it, for the tests that compare a cell with it.

torch's gloo teardown can abort a script that finished its work, at exit: SIGABRT, "terminate called
without an active exception" (about 1 run in 25 here; torch's own race, the one behind issue 21's hang).
A run that torchrun reports ended that way (``exitcode: -6``) is run once more, from the same files (what
the first run made in ``cwd`` is removed); any other failure stands. A run past its timeout is ended with
every process under it (torchrun's workers run in sessions of their own: killing torchrun alone, or its
process group, leaves them running), then ``subprocess.TimeoutExpired`` is raised."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TORCHRUN = Path(sys.executable).parent / "torchrun"
ABORTED = "exitcode: -6"


def torchrun(script, *args, cwd, timeout: float, log_dir: Path | None = None, redirects: int = 1):
    """``torchrun --standalone --nproc-per-node 2 [--redirects R --log-dir D] script args...``."""
    logs = ["--redirects", str(redirects), "--log-dir", str(log_dir)] if log_dir is not None else []
    before = set(Path(cwd).iterdir())
    for _ in range(2):
        for made in set(Path(cwd).iterdir()) - before:  # the retry starts where the first run did (a script
            shutil.rmtree(made) if made.is_dir() else made.unlink()  # resumes from a snapshot it finds there)
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)  # the retry's logs only
        run = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", *logs, script, *map(str, args)], cwd, timeout)
        if run.returncode == 0 or ABORTED not in run.stderr:
            return run
    return run


def _run(cmd: list, cwd, timeout: float) -> subprocess.CompletedProcess:
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            under = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            under = []
        for p in [*under, psutil.Process(proc.pid)] if proc.poll() is None else under:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
