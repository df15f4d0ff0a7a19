"""The keeper's loop: one select over its holder's socket, its listening socket, the ranks' pidfds, and, while no
kernel holds the pool, the ranks' pipes.

- While a kernel holds the pool, the keeper only holds duplicates of every kernel-side descriptor of each rank
  (wire/keepmessages.py's ``RANK_FDS``), sent by that kernel with each ``Hold``; it reads nothing.
- The holder's socket closing without ``End`` is the kernel's end (killed, crashed, out of memory, Jupyter's
  restarter killing its group, a shutdown). The keeper then reads the ranks' pipes, so none blocks on a full pipe:
  their text and records are kept, bounded (``KEPT_TEXT``, ``KEPT_RECORDS``), with the order of its reads across
  ranks (``Reads``: the next kernel replays the text as it was written), for the next kernel, and the pool
  waits ``About.keep_s`` for one. At the end of the wait every rank's process group is ended (SIGTERM, SIGKILL
  ``timeline.GRACE_S`` later) and the keeper exits, its socket file removed.
- ``Take`` from another kernel of the same user (``SO_PEERCRED``: any other user's connection is closed at once)
  hands it every descriptor and what was kept; that connection is the holder's from then on. A second ``Take``
  while one holds it is refused, naming the holder.
- ``End`` ends the pool: the keeper waits for its ranks to leave (the kernel stops them), then exits.
"""
from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import dataclasses
import os
import selectors
import signal
import socket
import struct
import sys
import time

from .. import timeline
from ..wire import fdframing
from ..wire.keepmessages import About, Describe, End, Hold, InRanks, Kept, KeptRank, NotTaken, Take, Taken

NAME = b"nbddp-keeper"
INTERRUPT = signal.SIGUSR2  # a rank's interrupt (rank/server.py's INTERRUPT; the keeper imports no rank code)
KEPT_TEXT = 16 << 20  # per rank and stream, the newest bytes a rank printed while no kernel held the pool
KEPT_RECORDS = 64 << 20  # per rank, its records (displays, metrics, answers); past it the rank waits to send more
LEAVE_S = timeline.STOP_S + timeline.GRACE_S + 1.0  # after End, the ranks leave within this, or are killed
ANSWER_S = 10.0  # a frame begun is whole within this (a kernel's Hold, another kernel's request)
# what an exchange with a kernel can raise: it went away, sent what does not unpickle, or sent something else
KEEPER_ERRORS = (EOFError, OSError, fdframing.Unreadable, AttributeError, TypeError, ValueError, KeyError)


def peer_uid(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class Clock:
    """The keeper's one count of its reads of every rank's pipes (``Reads``)."""

    def __init__(self):
        self.last = -1

    def tick(self) -> int:
        self.last += 1
        return self.last


class Reads:
    """When each read of a rank's pipes came (a ``Clock`` tick) and where it ended, so that the next kernel replays
    what every rank wrote, text and records, in the order it was written, not rank by rank. 16 bytes a read (reads
    with no other between them are one); reads wholly before the kept text are let go as it is."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.reads = {s: (array.array("q"), array.array("q")) for s in ("stdout", "stderr", "channel")}  # whens, ends
        self.total = dict.fromkeys(self.reads, 0)  # bytes ever read from each stream (a read's end is one of them)

    def add(self, stream: str, n: int, kept: int) -> None:
        """``n`` bytes read from ``stream``, of which (with what came before) the newest ``kept`` are kept."""
        whens, ends = self.reads[stream]
        self.total[stream] += n
        if whens and whens[-1] == self.clock.last:  # (no read of another pipe since: one read)
            ends[-1] = self.total[stream]
            return
        whens.append(self.clock.tick())
        ends.append(self.total[stream])
        if len(ends) > 4096 and ends[len(ends) // 2] <= self.total[stream] - kept:  # (the older half let go)
            gone = bisect.bisect_right(ends, self.total[stream] - kept)
            del whens[:gone], ends[:gone]

    def order(self, rank: int, kept: dict) -> list:
        """(when, rank, stream, bytes) of each read whose bytes are (partly) in ``kept``, oldest first."""
        out = []
        for stream, (whens, ends) in self.reads.items():
            prev = self.total[stream] - len(kept[stream])
            for when, end in zip(whens, ends):
                if end > prev:
                    out.append((when, rank, stream, end - prev))
                    prev = end
        return out


def replay_order(ranks) -> list:
    """(rank, stream, bytes) in the order the keeper read the ranks' pipes: what the next kernel feeds first."""
    reads = sorted(o for r in ranks for o in r.reads.order(r.rank, r.kept))
    merged: list = []
    for _, rank, stream, n in reads:
        if merged and merged[-1][:2] == (rank, stream):
            merged[-1] = (rank, stream, merged[-1][2] + n)
        else:
            merged.append((rank, stream, n))
    return merged


class Rank:
    def __init__(self, kept: KeptRank, fds: list[int], clock=None):
        self.rank, self.pid = kept.rank, kept.pid
        self.fds = dict(zip(kept.fds, fds))
        self.alive = True
        self.kept = {"stdout": bytearray(), "stderr": bytearray(), "channel": bytearray()}
        self.dropped = {"stdout": 0, "stderr": 0}
        self.reads = Reads(clock if clock is not None else Clock())
        self.log: int | None = None  # its rankN.log, while no kernel holds the pool (open_log)

    def open_log(self, run_dir: str) -> None:
        if self.log is None and run_dir:
            with contextlib.suppress(OSError):
                self.log = os.open(os.path.join(run_dir, f"rank{self.rank}.log"),
                                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def take_in(self, stream: str) -> bool:
        """What its ``stream`` pipe holds now: text into its log (every byte, as a kernel would write it) and the
        newest ``KEPT_TEXT`` of it kept for the next kernel's cell; records kept whole. False once the pipe says no
        more (its end, nothing now), or its records reached ``KEPT_RECORDS``."""
        fd = self.fds.get(stream)
        try:
            data = os.read(fd, 1 << 16) if fd is not None else b""
        except OSError:  # (BlockingIOError: nothing now)
            return False
        kept = self.kept[stream]
        kept += data
        if stream == "channel":
            if data:
                self.reads.add(stream, len(data), len(kept))
            return bool(data) and len(kept) < KEPT_RECORDS
        if self.log is not None and data:
            os.write(self.log, data)
        if len(kept) > KEPT_TEXT:
            self.dropped[stream] += len(kept) - KEPT_TEXT
            del kept[:len(kept) - KEPT_TEXT]
        if data:
            self.reads.add(stream, len(data), len(kept))
        return bool(data)

    def given(self) -> None:
        """What it kept went to a kernel: nothing kept from now on."""
        for v in self.kept.values():
            v.clear()
        self.reads = Reads(self.reads.clock)

    def close(self) -> None:
        if self.log is not None:
            os.close(self.log)
            self.log = None
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}

    def signal(self, sig: int, group: bool = True) -> None:
        """``sig`` to the rank's process group (``group``; else to the rank alone), if its pidfd says it is still
        there."""
        pidfd = self.fds.get("pidfd")
        if pidfd is None or not self.alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(pidfd, 0)
            try:
                if not group:
                    raise ProcessLookupError
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(pidfd, sig)


class Keeper:
    def __init__(self, holder: socket.socket, listener: socket.socket, path: str):
        self.sel = selectors.DefaultSelector()
        self.holder: socket.socket | None = None
        self.listener, self.path = listener, path
        self.about: About | None = None
        self.state = b""
        self.ranks: dict[int, Rank] = {}
        self.orphaned_at: float | None = None  # time.time(), while no kernel holds the pool
        self.wait_until: float | None = None  # time.monotonic(): the wait's end, or End's
        self.kill_at: float | None = None
        self.ending = False  # the holder ended the pool (End): the keeper goes once its ranks have
        self.why = ""  # how it ended while no kernel held it
        self.done = False
        self.clock = Clock()  # (the order of the ranks' reads: Reads)
        self._hold(holder)
        self.sel.register(listener, selectors.EVENT_READ, ("listener", None))

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.done:
                now = time.monotonic()
                wake = [t for t in (self.wait_until, self.kill_at) if t is not None]
                for key, _ in self.sel.select(max(0.0, min(wake) - now) if wake else None):
                    kind, what = key.data
                    try:
                        getattr(self, f"_on_{kind}")(what, key.fileobj)
                    except KEEPER_ERRORS as e:  # one bad exchange never ends the pool
                        say(f"{kind}: {type(e).__name__}: {e}")
                        if kind == "holder" and not self.ending:
                            self._orphaned("its kernel's word was cut short")
                now = time.monotonic()
                if self.kill_at is not None and now >= self.kill_at:
                    self._end_ranks(signal.SIGKILL)
                    self.done = True
                elif self.wait_until is not None and now >= self.wait_until and self.kill_at is None:
                    if self.holder is None and not self.ending:
                        self._ends(f"no kernel took it within its --keep {self.about.keep_s:g} s; it ended")
                    else:
                        say("its ranks did not leave in time: ended")
                        self._end_ranks(signal.SIGTERM)
                        self.kill_at = now + timeline.GRACE_S
                gone = not any(r.alive for r in self.ranks.values())
                if gone and (self.ending or self.ranks and self.holder is None):
                    say("every rank has ended")
                    self.done = True
        finally:
            self.close()

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for r in self.ranks.values():
            r.close()
        self.sel.close()
        self.listener.close()
        if self.holder is not None:
            self.holder.close()

    # -- the holder -----------------------------------------------------------------------------------------
    def _hold(self, conn: socket.socket) -> None:
        self.holder = conn
        self.orphaned_at = self.wait_until = None
        self.sel.register(conn, selectors.EVENT_READ, ("holder", None))

    def _on_holder(self, _, conn: socket.socket) -> None:
        try:
            msg, fds = fdframing.receive(conn)
        except (EOFError, OSError) as e:
            say(f"its kernel's socket: {type(e).__name__}: {e}")
            if self.ending:  # (the kernel that ended the pool let go of its end)
                self.sel.unregister(conn)
                conn.close()
                self.holder = None
            else:
                self._orphaned("its kernel ended without a word")
            return
        if isinstance(msg, Hold):
            self._take_hold(msg, conn)
            fdframing.send(conn, Kept())
        elif isinstance(msg, InRanks) and self.about is not None:
            self.about = dataclasses.replace(self.about, **vars(msg))  # (each field of InRanks is one of About's)
        elif isinstance(msg, End):
            say("ended by its kernel")
            self.ending = True
            self.wait_until = time.monotonic() + LEAVE_S
        for fd in fds:
            os.close(fd)

    def _take_hold(self, hold: Hold, conn: socket.socket) -> None:
        """The holder's new word: the pool's description and every rank's descriptors (the last ones let go)."""
        ranks = {}
        conn.settimeout(ANSWER_S)
        try:
            for _ in range(hold.ranks):
                kept, fds = fdframing.receive(conn)
                ranks[kept.rank] = Rank(kept, fds, self.clock)
        except KEEPER_ERRORS:
            for r in ranks.values():
                r.close()
            raise
        finally:
            conn.settimeout(None)
        for r in self.ranks.values():
            self._unwatch(r)
            if r.alive:
                self.sel.unregister(r.fds["pidfd"])
            r.close()
        self.about, self.state, self.ranks = hold.about, hold.state, ranks
        for r in ranks.values():
            self.sel.register(r.fds["pidfd"], selectors.EVENT_READ, ("exit", r))

    def _orphaned(self, why: str) -> None:
        if self.holder is not None:
            self.sel.unregister(self.holder)
            self.holder.close()
            self.holder = None
        if self.about is None:  # (the kernel ended during %ddp start: its ranks, tied to this keeper, end with it)
            say(f"{why} before its pool was up: nothing to keep")
            self.done = True
            return
        say(f"{why}; its pool waits {self.about.keep_s:g} s for a kernel to take it")
        self.orphaned_at, self.wait_until = time.time(), time.monotonic() + self.about.keep_s
        for r in self.ranks.values():
            if r.alive:
                r.open_log(self.about.run_dir)
                self._watch(r)
        missing = sorted(set(range(self.about.world_size)) - {r.rank for r in self.ranks.values() if r.alive})
        if missing or self.about.mending:  # (its kernel ended while it mended them: only a kernel mends a pool)
            lost = f"rank(s) {', '.join(map(str, missing))} had ended" if missing else "it was being mended"
            self._ends(f"{lost} when its kernel ended (a pool is mended by a kernel; ranks half mended wait for it "
                       "for ever), so it ended with it")
            return
        if self.about.running and not self.about.background:  # the notebook's cell: nobody waits for it any more
            say(f"interrupting the cell its kernel was running ({self.about.running}); a --bg cell would go on")
            for r in self.ranks.values():
                r.signal(INTERRUPT, group=False)  # (its own: a KeyboardInterrupt in the cell, as Jupyter's interrupt)

    # -- the ranks --------------------------------------------------------------------------------------------
    def _watch(self, r: Rank) -> None:
        """Read the rank's pipes (no kernel does), so that it never blocks on a full one."""
        for stream in ("stdout", "stderr", "channel"):
            fd = r.fds.get(stream)
            if fd is not None:
                os.set_blocking(fd, False)
                self.sel.register(fd, selectors.EVENT_READ, ("pipe", (r, stream)))

    def _unwatch(self, r: Rank) -> None:
        for stream in ("stdout", "stderr", "channel"):
            fd = r.fds.get(stream)
            if fd is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(fd)

    def _on_pipe(self, what, _fd) -> None:
        r, stream = what
        if not r.take_in(stream):  # its end, or (records) as much as it keeps: the rank waits until a kernel takes it
            self.sel.unregister(r.fds[stream])

    def _on_exit(self, r: Rank, _fd) -> None:
        self.sel.unregister(r.fds["pidfd"])
        r.alive = False
        if self.holder is None:  # what it wrote last is read before its pipes are let go
            for stream in ("stdout", "stderr", "channel"):
                while r.take_in(stream):
                    pass
        if self.holder is None and self.kill_at is None:  # (not one the keeper is ending)
            self._ends(f"rank {r.rank} (pid {r.pid}) ended while no kernel held the pool; a pool is mended by a "
                       "kernel, so it ended with it")

    def _ends(self, why: str) -> None:
        """The pool ends while no kernel holds it: its ranks stopped (SIGTERM, then SIGKILL), ``why`` kept beside its
        socket for the next kernel to read (``keeping.kept``)."""
        say(why)
        self.why = why
        if self.about is not None:  # (at once: a kernel that looks while its ranks end finds this, not the pool)
            leave_word(self.path, self.about, why)
        if self.kill_at is None:
            self._end_ranks(signal.SIGTERM)
            self.kill_at = time.monotonic() + timeline.GRACE_S

    def _end_ranks(self, sig: int) -> None:
        for r in self.ranks.values():
            r.signal(sig)

    # -- other kernels -----------------------------------------------------------------------------------------
    def _on_listener(self, _, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        pid, uid = peer_uid(conn)
        if uid != os.getuid():
            say(f"refused a connection from uid {uid} (pid {pid}): only uid {os.getuid()} may reach this pool")
            conn.close()
            return
        conn.settimeout(ANSWER_S)  # (a client that sends half a frame never stalls the keeper)
        self.sel.register(conn, selectors.EVENT_READ, ("client", pid))

    def _on_client(self, pid: int, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        try:
            msg, fds = fdframing.receive(conn)
            for fd in fds:
                os.close(fd)
            if self.about is None:  # (its kernel's first Hold is not in yet)
                fdframing.send(conn, NotTaken("the pool is still starting"))
            elif self.why:  # (ending while no kernel held it: said in its .ended file)
                fdframing.send(conn, NotTaken(f"it has ended: {self.why}"))
            elif isinstance(msg, Describe):
                fdframing.send(conn, self.described())
            elif isinstance(msg, Take):
                if self._give(conn, pid):
                    return
            else:
                fdframing.send(conn, NotTaken(f"the keeper does not take {type(msg).__name__}"))
        except (EOFError, OSError, fdframing.Unreadable):
            pass
        conn.close()

    def described(self) -> About:
        return dataclasses.replace(self.about, holder_pid=self._holder_pid(), orphaned_at=self.orphaned_at,
                                   ranks_alive=sum(r.alive for r in self.ranks.values()), keeper_pid=os.getpid())

    def _holder_pid(self) -> int | None:
        return peer_uid(self.holder)[0] if self.holder is not None else None

    def _give(self, conn: socket.socket, pid: int) -> bool:
        """The pool to the kernel at ``conn`` (True), or refused, saying why (False)."""
        if self.holder is not None:
            fdframing.send(conn, NotTaken(f"kernel pid {self._holder_pid()} holds it"))
            return False
        if self.ending or self.kill_at is not None or not all(r.alive for r in self.ranks.values()):
            fdframing.send(conn, NotTaken("it is ending: its wait ran out, a rank ended, or its kernel ended it"))
            return False
        live = list(self.ranks.values())
        fdframing.send(conn, Taken(self.described(), self.state, len(live),
                                   buffered={r.rank: {k: bytes(v) for k, v in r.kept.items()} for r in live},
                                   dropped={r.rank: dict(r.dropped) for r in live}, order=replay_order(live)))
        for r in live:  # (a taker gone midway: the keeper goes on reading, as before)
            fdframing.send(conn, KeptRank(r.rank, r.pid, tuple(r.fds)), list(r.fds.values()))
        for r in live:
            self._unwatch(r)
            r.given()
        conn.settimeout(None)
        say(f"taken by kernel pid {pid}")
        self._hold(conn)
        return True


def leave_word(path: str, about: About, why: str) -> None:
    """Why a kept pool ended while no kernel held it, beside its socket (read, and removed, by the next kernel's
    ``%load_ext``: ``keeping.ended``)."""
    with contextlib.suppress(OSError), open(path[:-len(".sock")] + ".ended", "w") as f:
        f.write(f"kept pool {about.pool_id} ({about.world_size} rank(s) on {about.devices}, {about.options}) has "
                f"ended: {why}. Its logs: {about.run_dir}\n")


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} nbddp-keeper {os.getpid()}: {text}", file=sys.stderr, flush=True)


def main(argv=None) -> None:
    """``python -m nbddp.keeper HOLDER_FD LISTENER_FD SOCKET_PATH``: the descriptors it was started with."""
    holder_fd, listener_fd, path = (argv or sys.argv[1:])[:3]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, NAME, 0, 0, 0)  # PR_SET_NAME: nbddp-keeper in ps
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    holder = socket.socket(fileno=int(holder_fd))
    listener = socket.socket(fileno=int(listener_fd))
    Keeper(holder, listener, path).run()
