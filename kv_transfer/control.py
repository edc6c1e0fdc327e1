"""The small control channel of the `shm` and `collective` transports (no KV bytes on it).

A sender starts one `ControlServer` at worker start; it accepts TCP connections on
its bind address and runs one thread per connection. A receiver opens a connection
(`ControlConnection`) and exchanges length-prefixed JSON messages: `shm` keeps idle
connections per sender and reuses one per transfer (`begin`), `collective` keeps one
per sender/receiver pair for the pair's life, so a dead receiver is seen as that
connection closing. Every request carries the
cluster token; a wrong token is answered with `unauthorized` and the connection closed.
Nothing is pickled: messages are JSON objects.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 16 << 20


class ChannelClosed(ConnectionError):
    """The other end closed the connection (or died) before a full message arrived."""


def send_message(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_message(sock: socket.socket) -> dict:
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_MESSAGE:
        raise ChannelClosed(f"control message of {length} bytes refused")
    return json.loads(_recv_exact(sock, length))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ChannelClosed("connection closed by peer")
        buf += part
    return bytes(buf)


Handler = Callable[[socket.socket, dict], None]
"""Serves one connection after its first (authenticated) message; owns the socket."""


class ControlServer:
    """Accept loop on a daemon thread; each connection is handed to `handler`."""

    def __init__(self, host: str, token: str, handler: Handler, name: str):
        self.token = token
        self.handler = handler
        self._sock = socket.create_server((host, 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                first = recv_message(conn)
                if not hmac.compare_digest(str(first.get("token", "")), self.token):
                    send_message(conn, {"ok": False, "reason": "unauthorized"})
                    return
                self.handler(conn, first)
            except (ChannelClosed, OSError) as exc:
                logger.debug("control connection ended: %s", exc)

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class ControlConnection:
    """Receiver side of one control connection; each `call` is one request, one reply."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float):
        self.token = token
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._authenticated = False
        self.accepted = False
        """Set by the owner once the server answered a request on it (token accepted)."""

    def call(self, message: dict, timeout_s: float | None = None) -> dict:
        if timeout_s is not None:
            self.sock.settimeout(timeout_s)
        self.send(message)
        return recv_message(self.sock)

    def send(self, message: dict) -> None:
        """Send a request without waiting: its reply is read later with `recv`."""
        if not self._authenticated:
            message = {**message, "token": self.token}
            self._authenticated = True
        send_message(self.sock, message)

    def recv(self, timeout_s: float) -> dict:
        self.sock.settimeout(timeout_s)
        return recv_message(self.sock)

    def close(self) -> None:
        self.sock.close()


def responsive(host: str, port: int, token: str, timeout_s: float = 1.0) -> bool:
    """Whether the sender still answers a request: tells a dead sender from a dropped
    transfer. A full round trip, because a dying process can still accept a connect."""
    try:
        conn = ControlConnection(host, port, token, timeout_s)
    except OSError:
        return False
    try:
        conn.call({"op": "heartbeat", "request_id": ""}, timeout_s)
        return True
    except (ChannelClosed, OSError):
        return False
    finally:
        conn.close()
