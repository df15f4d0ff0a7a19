"""One Debug Adapter Protocol client session on a loopback socket: how the kernel's debug panel
(kernel/debugger/rankdebug.py) talks to one rank's debugger, through the debugpy adapter the kernel's own debugger
started (``debugpy.listen`` on 127.0.0.1). Messages are framed as the protocol says (a ``Content-Length``
header, then JSON); one reader thread answers requests and hands events on."""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import socket
import threading

HEADER = b"Content-Length: "


class DapError(RuntimeError):
    pass


def untraced(thread: threading.Thread) -> threading.Thread:
    """A thread of nbddp's in the kernel that the kernel's own debugger neither traces nor lists."""
    thread.pydev_do_not_trace = True
    thread.is_pydev_daemon_thread = True  # (left out of the kernel's threads, as debugpy's own are)
    return thread


class DapSession:
    """``request(command, arguments)`` waits for the response; ``send(command, arguments)`` returns a
    future of it; ``on_event(event)`` is called from the reader thread; ``on_close()`` once, when the
    connection ends either way."""

    def __init__(self, host: str, port: int, on_event, on_close=None, timeout: float = 10.0):
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.settimeout(None)
        self.on_event, self.on_close = on_event, on_close
        self.seq = itertools.count(1)
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.lock = threading.Lock()  # pending, closed (the reader takes it for each response)
        self.send_lock = threading.Lock()  # one message on the socket at a time (a send that blocks holds no reply up)
        self.closed = False
        self.reader = untraced(threading.Thread(target=self._read, name="nbddp-dap", daemon=True))
        self.reader.start()

    def send(self, command: str, arguments: dict | None = None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.send_lock:
            with self.lock:
                if self.closed:
                    future.set_exception(DapError("the rank's debugger connection is closed"))
                    return future
                seq = next(self.seq)
                self.pending[seq] = future  # (before it is sent: its response can come at once)
            body = json.dumps({"seq": seq, "type": "request", "command": command,
                               "arguments": arguments or {}}).encode()
            try:
                self.sock.sendall(HEADER + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError as e:
                with self.lock:
                    mine = self.pending.pop(seq, None) is not None  # (else the reader's end failed it)
                if mine:
                    future.set_exception(DapError(f"the rank's debugger connection failed: {e}"))
        return future

    def request(self, command: str, arguments: dict | None = None, timeout: float = 10.0) -> dict:
        return self.send(command, arguments).result(timeout)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = self.sock.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = next(int(line[len(HEADER):]) for line in head.split(b"\r\n") if line.startswith(HEADER))
                while len(buf) < length:
                    chunk = self.sock.recv(max(65536, length - len(buf)))
                    if not chunk:
                        return
                    buf += chunk
                msg, buf = json.loads(buf[:length]), buf[length:]
                self._dispatch(msg)
        except OSError:
            return
        finally:
            self._closed()

    def _dispatch(self, msg: dict) -> None:
        if msg.get("type") == "response":
            with self.lock:
                future = self.pending.pop(msg.get("request_seq"), None)
            if future is not None and not future.done():  # (one given up on: cancelled by its waiter's timeout)
                future.set_result(msg)
        elif msg.get("type") == "event":
            try:
                self.on_event(msg)
            except Exception:  # a listener's failure must not end the reader thread: logged
                logging.getLogger(__name__).exception("nbddp: a rank's debugger event %r", msg.get("event"))

    def _closed(self) -> None:
        with self.lock:
            self.closed = True
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(DapError("the rank's debugger connection closed"))
        if self.on_close is not None:
            self.on_close()
