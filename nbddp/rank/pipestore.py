"""In a forked rank: the process group's store, reached over two pipes instead of a port.

Each forked rank gets a request pipe and a reply pipe, and every store operation is one framed request
answered by the kernel's store (nbddp/kernel/ranks/groupstore.py, served by a kernel thread): it answers a
wait as soon as the key is set, where a FileStore polls every 10 ms. A pool across nodes (``%ddp start
--cluster ray``) cannot meet through a FileStore anyway (the nodes share no disk) and opens no store
port: its other nodes' ranks reach the same store through their agent over Ray. ``PipeStore`` is a
``torch.distributed.Store`` written in Python, so gloo and NCCL bootstrap through it as through any store.

Requests carry an id; a reply to a request that timed out here is dropped when it arrives late.
"""
from __future__ import annotations

import datetime
import functools
import os
import select
import threading
import time

from ..wire.framing import Reader, encode, write_all

_kept: list = []  # the store object must outlive every group made on it (torch holds only its C++ half)


def connect(request_fd: int, reply_fd: int, timeout_s: float):
    store = store_class()(request_fd, reply_fd, timeout_s)
    _kept.append(store)
    return store


@functools.lru_cache(maxsize=1)
def store_class():
    import torch.distributed as dist

    class PipeStore(dist.Store):
        def __init__(self, request_fd: int, reply_fd: int, timeout_s: float):
            super().__init__()
            self.request_fd, self.reply_fd, self.timeout_s = request_fd, reply_fd, timeout_s
            self.lock = threading.Lock()
            self.reader = Reader()  # the replies, framed as the kernel's channel frames its records
            self.next_id = 0

        def _call(self, op: str, *args, timeout_s: float | None = None):
            with self.lock:
                self.next_id += 1
                rid = self.next_id
                write_all(self.request_fd, encode((rid, op, args)))
                end = time.monotonic() + (timeout_s or self.timeout_s)
                replies = self.reader.feed(b"")
                while True:
                    for (got, ok, value), _ in replies:  # (a late reply to a request that timed out: dropped)
                        if got == rid:
                            if not ok:
                                raise dist.DistStoreError(value)
                            return value
                    left = end - time.monotonic()
                    if left <= 0 or not select.select([self.reply_fd], [], [], left)[0]:
                        raise dist.DistStoreError(f"store {op}{args!r} timed out after "
                                                  f"{timeout_s or self.timeout_s:g} s (nbddp's store in the kernel)")
                    data = os.read(self.reply_fd, 1 << 16)
                    if not data:
                        raise dist.DistStoreError(
                            "nbddp's store is gone (the kernel, or a cluster pool's agent, ended)")
                    replies = self.reader.feed(data)

        def set(self, key, value):
            self._call("set", key, _bytes(value))

        def get(self, key):
            return self._call("get", key)

        def add(self, key, amount):
            return self._call("add", key, int(amount))

        def compare_set(self, key, expected, desired):
            return self._call("compare_set", key, _bytes(expected), _bytes(desired))

        def append(self, key, value):
            self._call("append", key, _bytes(value))

        def multi_get(self, keys):
            return self._call("multi_get", list(keys))

        def multi_set(self, keys, values):
            self._call("multi_set", list(keys), [_bytes(v) for v in values])

        def wait(self, keys, timeout=None):
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
            self._call("wait", list(keys), timeout_s=seconds or None)

        def check(self, keys):
            return self._call("check", list(keys))

        def delete_key(self, key):
            return self._call("delete_key", key)

        def num_keys(self):
            return self._call("num_keys")

        def list_keys(self):
            return self._call("list_keys")

        def has_extended_api(self):
            return False

        def clone(self):
            return self  # one connection, its calls serialised by the lock

    return PipeStore


def _bytes(v) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode() if not isinstance(v, (bytearray, memoryview)) else bytes(v)
