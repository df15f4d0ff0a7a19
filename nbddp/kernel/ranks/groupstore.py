"""In the kernel: the one store of a forked gang's process group (one-shot, pool, cluster pool), answering
every rank without a port, and a wait as soon as its key is set (a FileStore polls every 10 ms).

Requests arrive as frames (wire/framing.py's, sent by rank/pipestore.py): the kernel's own ranks' on their
store pipes (starters.store_pipes), read by ``LocalStores`` (one thread), a cluster pool's other nodes'
ranks' through their agent's event stream (cluster/remote.py).
``Store.handle`` answers at once, or, for ``get``/``wait`` of keys not set yet, once another rank sets
them; every answer goes back through the ``reply`` function the request came with. Thread-safe: the
stream readers and the local thread call it concurrently.
"""
from __future__ import annotations

import os
import select
import threading

from ...wire.framing import Reader, encode, write_all


class Store:
    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.waiting: list = []  # (keys, request, reply) whose keys are not all set yet

    def handle(self, request, reply) -> None:
        """``request``: (id, op, args); ``reply(frame)`` is called with the answer's frame (maybe later)."""
        rid, op, args = request
        with self.lock:
            keys = args[0] if op in ("wait", "multi_get") else [args[0]] if op == "get" else None
            if keys is not None and not all(k in self.data for k in keys):
                self.waiting.append((keys, request, reply))
                return
            try:
                answer = (rid, True, getattr(self, "_" + op)(*args))
            except (AttributeError, LookupError, TypeError, ValueError) as e:  # the rank raises it (an op this store
                # lacks, arguments it cannot take, a count that is no number: the ops below are dict operations)
                answer = (rid, False, f"{type(e).__name__}: {e}")
            ready = self._ready() if op in ("set", "add", "compare_set", "append", "multi_set") else []
        reply(encode(answer))
        for waiter, reply_to in ready:
            self.handle(waiter, reply_to)

    def _ready(self) -> list:
        ready = [(r, f) for keys, r, f in self.waiting if all(k in self.data for k in keys)]
        if ready:
            self.waiting = [w for w in self.waiting if not all(k in self.data for k in w[0])]
        return ready

    # -- the operations (under the lock) ------------------------------------------------------------
    def _set(self, key, value):
        self.data[key] = value

    def _get(self, key):
        return self.data[key]

    def _add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def _compare_set(self, key, expected, desired):
        current = self.data.get(key)
        if (current is None and expected == b"") or current == expected:
            self.data[key] = desired
            return desired
        return expected if current is None else current

    def _append(self, key, value):
        self.data[key] = self.data.get(key, b"") + value

    def _multi_get(self, keys):
        return [self.data[k] for k in keys]

    def _multi_set(self, keys, values):
        self.data.update(zip(keys, values))

    def _wait(self, keys):
        return None

    def _check(self, keys):
        return all(k in self.data for k in keys)

    def _delete_key(self, key):
        return self.data.pop(key, None) is not None

    def _num_keys(self):
        return len(self.data)

    def _list_keys(self):
        return list(self.data)


class LocalStores:
    """The kernel's own ranks' store pipes, served by one thread (a rank asks while the kernel's main
    thread waits in the supervisor, or does anything else)."""

    def __init__(self, store: Store):
        self.store = store
        self.pipes: dict[int, tuple[int, Reader]] = {}  # request fd -> (reply fd, its frames)
        self.wake_r, self.wake_w = os.pipe()
        self.thread: threading.Thread | None = None
        self.closed = False
        self._lock = threading.Lock()  # the pipes: added by the kernel's thread, served and dropped by this one

    def add(self, request_fd: int, reply_fd: int) -> None:
        """A rank's two store pipes; served from now on (a replacement forked while the thread runs too)."""
        with self._lock:
            self.pipes[request_fd] = (reply_fd, Reader())
        if self.thread is not None:
            _reply(self.wake_w, b"+")  # the thread lists its pipes again

    def fds(self) -> list[int]:
        """The kernel's descriptors here: every rank's two store pipes' ends, and the thread's wake pipe."""
        with self._lock:
            return [*self.pipes, *(reply for reply, _ in self.pipes.values()), self.wake_r, self.wake_w]

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, name="nbddp-store", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed:
            with self._lock:
                fds = [self.wake_r, *self.pipes]
            for fd in select.select(fds, [], [])[0]:
                if fd == self.wake_r:
                    _read(self.wake_r)
                    if self.closed:
                        return
                    break  # a pipe was added: list them again
                data = _read(fd)
                reply_fd, frames = self.pipes[fd]
                if not data:  # the rank is gone: its two pipes' ends here with it
                    with self._lock:
                        self.pipes.pop(fd)
                    for end in (fd, reply_fd):
                        try:
                            os.close(end)
                        except OSError:
                            pass
                    continue
                for request, _ in frames.feed(data):
                    self.store.handle(request, lambda frame, out=reply_fd: _reply(out, frame))

    def close(self) -> None:
        """Ends the thread, then closes its descriptors, once (a second call closes nothing: the numbers
        may be someone else's by then)."""
        if self.wake_w < 0:
            return
        self.closed = True
        _reply(self.wake_w, b"x")
        if self.thread is not None:
            self.thread.join(5)
            if self.thread.is_alive():
                return  # (its descriptors stay open rather than be reused under it)
        for fd in (*self.pipes, *(r for r, _ in self.pipes.values()), self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.pipes, self.wake_r, self.wake_w = {}, -1, -1


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def _reply(fd: int, frame: bytes) -> None:
    try:
        write_all(fd, frame)
    except OSError:
        pass  # the rank is gone
