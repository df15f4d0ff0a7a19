"""A kept pool (``%ddp start --keep``): the kernel's end of its keeper (nbddp/keeper/), and how another kernel of the
same user finds kept pools and takes one.

- ``KeeperLink.start``: the keeper started (a fresh interpreter in a session of its own) on a socket pair, with the
  pool's listening socket, bound here first in ``socket_dir()`` (0700, the user's own, checked); ``hold`` sends it
  the pool's description and every rank's kernel-side descriptors (again after the ranks change); ``end``: the pool
  ends on purpose.
- ``kept``: the pools kept on this machine for this user (each keeper asked, ``Describe``); ``take``: one of them
  (``Take``), its descriptors and what its ranks wrote meanwhile; the link that took it is the holder's.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from ... import units
from ...errors import UsageError
from ...ipy import session
from ...wire import fdframing
from ...wire.keepmessages import RANK_FDS, About, Describe, End, Hold, InRanks, Kept, KeptRank, NotTaken, Take, Taken
from . import rendezvous, starters

ANSWER_S = 10.0  # a keeper answers within this (it does nothing that takes longer)


@dataclass
class KeptState:
    """What the kernel that takes a kept pool needs to make its gang again (pickled by the holder, kept unread by the
    keeper): its options, plan, run directory, the specs its ranks were forked with and its group's generation."""

    config: object
    plan: object
    run_dir: object
    specs: dict
    generation: int
    started_at: float = 0.0


def pool_id(run_dir) -> str:
    """A kept pool's id, as ``%ddp attach ID`` takes it: its run directory's random tail (``0d95e7``)."""
    return run_dir.run_id.rpartition("-")[2]


def _dir_path() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == os.getuid() and len(runtime) < 80:
        return Path(runtime) / "nbddp"
    return Path(f"/tmp/nbddp-{os.getuid()}")


def socket_dir() -> Path:
    """Where this user's keepers listen: ``$XDG_RUNTIME_DIR/nbddp``, else (or where that path leaves too little room for
    a socket's name) ``/tmp/nbddp-UID``; made 0700 and checked to be this user's own and nobody else's (else refused:
    a pool is never kept where another user could reach it)."""
    path = _dir_path()
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UsageError(f"--keep: {path} is not a directory only you can open (owner uid {st.st_uid}, mode "
                         f"{stat.filemode(st.st_mode)}); nbddp keeps no pool there. Remove it, or set XDG_RUNTIME_DIR "
                         "to a directory of your own. Nothing started.")
    return path


def about(gang, state: KeptState) -> About:
    """What the next kernel is told of ``gang``'s pool."""
    from .. import options

    plan = gang.plan
    on = plan.accelerator if plan.accelerator == "cpu" else "GPU " + ",".join(map(str, plan.device_ids))
    names, running, background, cell, brings = gang.keeper.said if gang.keeper is not None else ((), "", False, "", ())
    return About(pool_id=pool_id(gang.run_dir), devices=f"{on} ({plan.backend})", world_size=plan.world_size,
                 options=options.line(gang.config), notebook=os.environ.get("JPY_SESSION_NAME", ""),
                 started_at=state.started_at, keep_s=keep_seconds(gang.config.keep) or 0.0,
                 run_dir=str(gang.run_dir.path), names=names, running=running, background=background, cell=cell,
                 brings=brings,
                 mending=gang.keeper.mending if gang.keeper is not None else False)


def rank_fds(proc, command_fd: int) -> tuple[KeptRank, list[int]]:
    """A rank's KeptRank and its kernel-side descriptors, in ``RANK_FDS`` order."""
    streams = {kind: fd for fd, kind in proc.fds.items()}
    fds = [proc.exit_fd, streams["stdout"], streams["stderr"], streams["channel"], command_fd, *proc.store_fds]
    return KeptRank(proc.rank, proc.pid, RANK_FDS[:len(fds)]), fds


class KeeperLink:
    """The holding kernel's end of a keeper: ``start`` one, or ``take`` a kept pool's."""

    def __init__(self, conn: socket.socket, keeper_pid: int, process=None):
        self.conn, self.keeper_pid, self.process = conn, keeper_pid, process  # (process: the Popen that started it)
        # the names the ranks hold, the cell running (its first line), whether a --bg one, its metrics' name, the
        # names its --out/--gather bring back: as told
        self.said: tuple = ((), "", False, "", ())
        self.mending = False  # the pool is being mended (``mending``), as told

    @classmethod
    def start(cls, pool_id: str, log_path: Path) -> "KeeperLink":
        path = socket_dir() / f"{pool_id}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        binding = path.with_suffix(".binding")  # (its name once it listens: a kernel that finds it then can connect)
        with contextlib.ExitStack() as failed, theirs, listener:  # whatever stops it, an interrupt too: nothing left
            failed.callback(mine.close)
            listener.bind(str(binding))
            failed.callback(binding.unlink, missing_ok=True)
            os.chmod(binding, 0o600)
            listener.listen(8)
            os.rename(binding, path)
            failed.callback(path.unlink, missing_ok=True)
            with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:  # private
                process = subprocess.Popen(
                    [sys.executable, "-m", "nbddp.keeper", str(theirs.fileno()), str(listener.fileno()), str(path)],
                    pass_fds=(theirs.fileno(), listener.fileno()), start_new_session=True, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=log, env=rendezvous.interpreter_env())
            failed.pop_all()
        return cls(mine, process.pid, process)

    def hold(self, about: About, state: KeptState, ranks: list[tuple[KeptRank, list[int]]]) -> None:
        """The pool as it is now, to the keeper: it holds every descriptor once this returns (an interrupt waits for
        the whole of it: a Hold cut short would leave the keeper's stream out of step)."""
        with starters.sigint_deferred():
            fdframing.send(self.conn, Hold(about, pickle.dumps(state), len(ranks)))
            for kept, fds in ranks:
                fdframing.send(self.conn, kept, fds)
        self.conn.settimeout(ANSWER_S)
        try:
            answer, _ = fdframing.receive(self.conn)
        finally:
            self.conn.settimeout(None)
        if not isinstance(answer, Kept):
            raise RuntimeError(f"the pool's keeper answered {answer!r}")

    def end(self) -> None:
        """The pool ends (its ranks are being stopped): the keeper goes once they have."""
        with contextlib.suppress(OSError):
            fdframing.send(self.conn, End())

    def close(self, wait_s: float = 0.0) -> None:
        self.conn.close()
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)


def _ask(path: Path, message, timeout: float = ANSWER_S):
    """(answer, the connection) from the keeper at ``path``; None if no keeper listens there (its file removed)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
        fdframing.send(conn, message)
        answer, _ = fdframing.receive(conn)
    except (ConnectionRefusedError, FileNotFoundError):
        conn.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a keeper that died (killed) left it
        return None
    except (OSError, EOFError):
        conn.close()
        return None
    return answer, conn


def _existing_dir() -> Path | None:
    """``socket_dir()`` if it exists already (looking for kept pools makes nothing), else None."""
    if not _dir_path().is_dir():
        return None
    try:
        return socket_dir()
    except (UsageError, OSError):
        return None


def kept() -> list[About]:
    """This user's kept pools on this machine, oldest first, each as its keeper describes it."""
    found = []
    where = _existing_dir()
    if where is None:
        return []
    paths = sorted(where.glob("*.sock"))
    for path in paths:
        got = _ask(path, Describe(), timeout=2.0)
        if got is not None:
            got[1].close()
            if isinstance(got[0], About):
                found.append(got[0])
    return sorted(found, key=lambda a: a.started_at)


def ended() -> list[str]:
    """What became of kept pools that ended while no kernel held them (their keepers' last word), each said once."""
    where = _existing_dir()
    said = []
    for path in sorted(where.glob("*.ended")) if where is not None else []:
        with contextlib.suppress(OSError):
            said.append(path.read_text().strip())
            path.unlink()
    return said


def take(pool_id: str) -> tuple[KeeperLink, Taken, KeptState, list[tuple[KeptRank, list[int]]]]:
    """The kept pool ``pool_id``, taken: its link (now this kernel's), what the keeper said, the pool's state and each
    rank's descriptors; UsageError if another kernel holds it or it is gone."""
    got = _ask(socket_dir() / f"{pool_id}.sock", Take())
    if got is None:
        raise UsageError(f"%ddp attach {pool_id}: no kept pool by that id (its wait ran out, or it ended). "
                         "%ddp pools lists the kept pools.")
    answer, conn = got
    if isinstance(answer, NotTaken):
        conn.close()
        raise UsageError(f"%ddp attach {pool_id}: the pool cannot be taken: {answer.why}. Nothing changed.")
    ranks = []
    with contextlib.ExitStack() as failed:  # whatever stops it: the descriptors received closed (the pool kept)
        failed.callback(conn.close)
        failed.callback(_close_all, ranks)
        for _ in range(answer.ranks):
            ranks.append(fdframing.receive(conn))
        state = pickle.loads(answer.state)
        failed.pop_all()
    return KeeperLink(conn, answer.about.keeper_pid), answer, state, ranks


def give_back(taken) -> None:
    """A take that did not finish before its gang was made: the descriptors closed, the keeper keeps the pool again."""
    link, _, _, ranks = taken
    _close_all(ranks)
    link.close()


def _close_all(ranks) -> None:
    """Every descriptor a take received (``(KeptRank, fds)`` per rank), closed."""
    for _, fds in ranks:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def describe(about: About, now: float | None = None) -> str:
    """One kept pool, in a line or two: its id, devices, notebook, since when, and whether a kernel holds it."""
    now = now or time.time()
    since = time.strftime("%H:%M:%S", time.localtime(about.started_at))
    if about.holder_pid is not None:
        state = f"held by kernel pid {about.holder_pid}"
    else:
        left = max(0.0, about.orphaned_at + about.keep_s - now) if about.orphaned_at else about.keep_s
        state = f"waiting for a kernel, {left / 60:.0f} min left"
    where = f", notebook {about.notebook}" if about.notebook else ""
    names = ", ".join(about.names[:8]) + (f" (+{len(about.names) - 8} more)" if len(about.names) > 8 else "")
    held = f"; its ranks hold {names}" if names else ""
    running = (f"; a {'--bg cell was running' if about.background else 'cell was running (interrupted)'} in them: "
               f"{about.running}") if about.running else ""
    return (f"{about.pool_id}: {about.world_size} rank(s) on {about.devices}{where}, started {since} "
            f"({about.options or 'default options'}); {about.ranks_alive} rank(s) alive{held}{running}; {state}")


@contextlib.contextmanager
def cell_told(gang, names, source: str, cell: str = "", brings: tuple = ()):
    """A pool cell's run, its keeper told (``InRanks``, unanswered, only when what it knew changed) that the cell runs
    (its first line; ``cell``: as nbddp.metrics() files its rows; ``brings``: its --out/--gather names) and, once it
    is over, the names the ranks hold (``names``, read then): what the next kernel is told if this one ends
    meanwhile."""
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    background = threading.current_thread() is not threading.main_thread()  # (the notebook's cells run on the main)
    tell(gang, names, first[:60] + ("…" if len(first) > 60 else ""), background, cell, brings)
    try:
        yield
    finally:
        tell(gang, names, "")


def tell(gang, names, running: str, background: bool = False, cell: str = "", brings: tuple = ()) -> None:
    """``gang``'s keeper told the names its ranks hold and the cell running in them (a --bg one: ``background``;
    ``cell``: its metrics' name; ``brings``: its --out/--gather names), if that changed."""
    link = gang.keeper if gang is not None else None
    if link is None:  # (a pool without a keeper pays nothing for it)
        return
    said = (tuple(sorted(names)), running, background, cell, tuple(brings))
    if said == link.said:
        return
    link.said = said
    _told(link)


def _told(link: KeeperLink) -> None:
    with contextlib.suppress(OSError):  # (a keeper gone: the pool's end is near, and said otherwise)
        fdframing.send(link.conn, InRanks(*link.said, mending=link.mending))


@contextlib.contextmanager
def mending(gang):
    """While ``gang``'s pool is mended or resized (ranks forked, retired, its group made anew): its keeper told, so
    that a kernel that ends meanwhile leaves no pool half mended (the keeper ends it; its ranks would wait for ever
    for the rest of a regroup only this kernel knew)."""
    link = gang.keeper if gang is not None else None
    if link is None:
        yield
        return
    link.mending = True
    _told(link)
    yield
    # mended: told so. Not when the mending was cut short (no ``finally``): the pool is torn down then
    # (Mending.mend), and until its keeper has the kernel's End a kernel that dies (Jupyter's restarter sends
    # SIGINT, then SIGKILL: the interrupt stops the mending, the kill lands while the pool ends) must leave it
    # "being mended", so that the keeper ends it rather than keep ranks half regrouped (a take then waited for ever)
    link.mending = False
    _told(link)


def this_notebooks(waiting: list) -> list:
    """The pools of ``waiting`` (``kept``'s) kept from this kernel's notebook: Jupyter's ``JPY_SESSION_NAME``, the
    same; without one, none (no pool is known as this kernel's)."""
    notebook = os.environ.get("JPY_SESSION_NAME", "")
    return [a for a in waiting if a.notebook == notebook] if notebook else []


def keep_seconds(value) -> float | None:
    """``--keep``'s value in seconds: None for off (auto: how long a pool whose kernel ended unplanned waits)."""
    from .. import options

    if value in (None, "off"):
        return None
    return options.KEEP_AUTO_S if value == options.KEEP_AUTO else units.seconds(value)


def kept_out(link: KeeperLink | None, prepare):
    """``prepare`` (starters.fork_specs'), and the kernel's end of its keeper's socket not inherited: a rank holding
    it would hide the kernel's end from the keeper."""
    def without(spec):
        spec, not_inherited, forked = prepare(spec) if prepare else (spec, (), None)
        return spec, [*not_inherited, *([link.conn.fileno()] if link is not None else [])], forked

    return without


def hold(gang) -> None:
    """A kept pool's keeper told of ``gang`` as it is now (its ranks, their descriptors): whenever they change."""
    if gang.keeper is None or gang.sup is None:
        return
    ranks = [rank_fds(p, gang.cmd_fds.get(p.rank)) for p in gang.sup.live() if gang.cmd_fds.get(p.rank) is not None]
    state = KeptState(gang.config, gang.plan, gang.run_dir, gang.specs, gang.generation, started_at=gang.started_at)
    gang.keeper.hold(about(gang, state), state, ranks)


def start(gang) -> KeeperLink | None:
    """``gang``'s keeper, started if it is a pool kept across its kernel's end (``--keep``); else None. By default
    (``--keep auto``) a pool that cannot be kept (across Ray nodes, from the forkserver, no pidfds: checks.py refuses
    them a duration) is not, and one whose keeper cannot start goes on unkept, saying why."""
    from .. import options

    if not gang.persistent or keep_seconds(gang.config.keep) is None:
        return None
    if not options.keep_asked(gang.config) and not keepable(gang):
        return None
    try:
        link = KeeperLink.start(pool_id(gang.run_dir), gang.run_dir.path / "keeper.log")
    except (UsageError, OSError) as e:
        if options.keep_asked(gang.config):
            raise
        print(f"nbddp: this pool is not kept if its kernel is killed: {e}", file=sys.stderr)
        return None
    ends_at_exit(gang)
    return link


def unkeepable(cluster, method: str | None = None) -> str:
    """Why a pool (``cluster``: across Ray nodes; ``method``: how its ranks start, where known) could not be kept
    across its kernel's end, its ranks taken by another kernel; "" if it can: forked from this kernel, on this
    machine, seen by pidfds. The one rule, for ``--keep``'s refusals (checks.py) and the default (``keepable``)."""
    if cluster:
        return "a pool across Ray nodes"
    if not hasattr(os, "pidfd_open"):
        return f"{sys.platform} has no pidfds"
    if method not in (None, "fork"):
        return f"a pool whose ranks start by {method} (the kernel holds CUDA, or --start-method says so)"
    return ""


def keepable(gang) -> bool:
    """A pool whose ranks another kernel can take (``unkeepable``)."""
    return not unkeepable(gang.config.cluster, gang.plan.start_method)


_ENDS_AT_EXIT: "weakref.WeakSet" = weakref.WeakSet()  # the gangs a deliberate end of the kernel ends (--keep auto)


def ends_at_exit(gang) -> None:
    """``gang``'s pool is kept only if its kernel ends unplanned (``--keep auto``): a deliberate end (Jupyter's
    shutdown or restart request, ``exit()``: Python's atexit runs; a SIGKILL, a crash or the out-of-memory killer
    never run it) ends it, as a pool that is not kept. A pool given a duration is kept either way."""
    from .. import options

    if options.keep_asked(gang.config):
        return
    atexit.unregister(_end_at_exit)  # (once, however many pools this kernel had)
    atexit.register(_end_at_exit)
    _ENDS_AT_EXIT.add(gang)


def _end_at_exit() -> None:
    """The kernel ends on purpose: each ``--keep auto`` pool's keeper told it ends, its ranks sent SIGTERM (the keeper
    SIGKILLs any not gone within ``keeper.LEAVE_S``)."""
    for gang in list(_ENDS_AT_EXIT):
        sup = gang.sup
        if sup is None or gang.keeper is None:
            continue
        end(gang.keeper)
        for proc in sup.live():
            proc.signal(signal.SIGTERM)


def reap_when_gone(pids: list[int]) -> None:
    """Ranks this kernel forked and no longer holds (``%ddp detach``): each reaped by a thread when it ends (its
    keeper's wait runs out, another kernel stops it), so none is left a zombie of this kernel."""
    def reap() -> None:
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    if pids:
        threading.Thread(target=reap, name="nbddp-reap-detached", daemon=True).start()


def tied(spec, link: KeeperLink | None):
    """A rank's spec, tied to the keeper of ``link`` (it dies with it, and lets go of the kernel's sockets)."""
    if link is None:
        return spec
    return dataclasses.replace(spec, keeper_pid=link.keeper_pid, kernel_ports=session.kernel_ports())


def end(link: KeeperLink | None) -> None:
    """The pool ends (its ranks stopped next): its keeper told; it goes once they have."""
    if link is not None:
        link.end()


def ended_with(link: KeeperLink | None) -> None:
    """Its ranks reaped: the link let go, the keeper (gone a moment later) reaped."""
    if link is not None:
        link.close(wait_s=2.0)
