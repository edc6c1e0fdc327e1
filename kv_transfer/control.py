"""The small control channel of the `shm` and `collective` transports (no KV bytes on it).

A sender starts one `ControlServer` at worker start; it accepts TCP connections on
its bind address and serves each on its own thread, at most `max_connections` at
once (one more is closed at once). A receiver opens a connection (`ControlConnection`)
and exchanges length-prefixed JSON messages: `shm` keeps idle connections per sender
and reuses one per transfer (`begin`), `collective` keeps one per sender/receiver pair
for the pair's life, so a dead receiver is seen as that connection closing.

Until a connection has shown the cluster token it is on a short leash: its TLS
handshake (when `tls_certfile` is set) and first message must arrive within
`auth_timeout_s`, and that message may announce at most `FIRST_MESSAGE_BYTES` (the
server reads the 4-byte header of a longer one and closes). A first message that is
not a JSON object closes the connection; a wrong token is answered `unauthorized`,
then closed. Authenticated connections may idle between requests (a collective pair
waits for its next fetch), but a message whose header arrived must finish within
`BODY_TIMEOUT_S`. Nothing is pickled: messages are JSON objects, which the transports
build and read as the dataclasses of kv_transfer/control_messages.py.
"""

from __future__ import annotations

import hmac
import json
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from kv_transfer.base import FailureReason
from kv_transfer.config import TransportOptions
from kv_transfer.control_messages import Heartbeat, Reply
from kv_transfer.listeners import bind_listener
from kv_transfer.tls import client_context, server_context, server_name

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 16 << 20
"""Largest message on an authenticated connection (a fetch lists its block ids)."""
FIRST_MESSAGE_BYTES = 64 << 10
"""Largest first message, read before the token is checked (`pair`, `begin`,
`heartbeat`: a few hundred bytes)."""
BODY_TIMEOUT_S = 30.0
"""How long an authenticated connection may take to deliver a message whose header
arrived, where the socket itself waits for ever (the server between requests)."""
ACCEPT_RETRY_S = 0.05
"""Pause after a failed accept (e.g. out of file descriptors) before the next try."""


class ChannelClosed(ConnectionError):
    """The other end closed the connection (or died) before a full message arrived."""


class MessageRefused(ChannelClosed):
    """A message too long, not JSON, or not a JSON object: the connection is dropped."""


def send_message(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_message(
    sock: socket.socket, max_bytes: int = MAX_MESSAGE, deadline: float | None = None
) -> dict:
    """One message; `deadline` (monotonic) bounds all of it. Without one, the socket's
    own timeout applies per read, and a socket that has none gets `BODY_TIMEOUT_S` for
    the body once the header is in. Longer than `max_bytes`: refused after the header."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if length > max_bytes:
        raise MessageRefused(f"control message of {length} bytes refused (max {max_bytes})")
    if deadline is None and sock.gettimeout() is None:
        deadline = time.monotonic() + BODY_TIMEOUT_S
    body = _recv_exact(sock, length, deadline)
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, absurd nesting
        raise MessageRefused(f"control message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise MessageRefused(f"control message is a {type(message).__name__}, not an object")
    return message


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    restore = sock.gettimeout()
    buf = bytearray()
    try:
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("control message not received in time")
                sock.settimeout(left)
            part = sock.recv(n - len(buf))
            if not part:
                raise ChannelClosed("connection closed by peer")
            buf += part
    finally:
        if deadline is not None:
            sock.settimeout(restore)
    return bytes(buf)


def token_matches(presented: object, expected: bytes) -> bool:
    """Constant-time comparison of a presented token (any JSON value) with ours."""
    if not isinstance(presented, str):
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), expected)


Handler = Callable[[socket.socket, dict], None]
"""Serves one connection after its first (authenticated) message; owns the socket."""


class ControlServer:
    """Accept loop on a daemon thread; each authenticated connection goes to `handler`
    on a thread of its own. Built by a transport's server at sender start."""

    def __init__(self, options: TransportOptions, handler: Handler, name: str):
        self.token = options.token.encode("utf-8", "surrogatepass")
        self.handler = handler
        self.auth_timeout_s = options.auth_timeout_s
        self._tls = server_context(options)
        self._slots = threading.BoundedSemaphore(options.max_connections)
        self._sock = bind_listener(options.bind_host)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                logger.warning("control server accept failed: %s", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            if not self._slots.acquire(blocking=False):
                logger.debug("control connection from %s refused: all slots busy", peer)
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread to be had
                self._slots.release()
                conn.close()

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.auth_timeout_s
            conn = self._secure(raw, deadline)
            first = recv_message(conn, FIRST_MESSAGE_BYTES, deadline)
            if not token_matches(first.get("token", ""), self.token):
                send_message(conn, Reply(False, FailureReason.UNAUTHORIZED).to_json())
                return
            conn.settimeout(None)  # authenticated: may idle between requests
            self.handler(conn, first)
        except (ChannelClosed, OSError) as exc:  # TimeoutError and ssl.SSLError included
            logger.debug("control connection ended: %s", exc)
        except Exception:  # one connection's bug must not go unseen, nor spread
            logger.warning("control connection failed", exc_info=True)
        finally:
            conn.close()
            raw.close()
            self._slots.release()

    def _secure(self, raw: socket.socket, deadline: float) -> socket.socket:
        """The TLS-wrapped socket, its handshake done by `deadline` however slowly the
        peer trickles it (a per-read timeout alone would let it stretch for ever)."""
        if self._tls is None:
            return raw
        conn = self._tls.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        conn.setblocking(False)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                conn.close()
                raise TimeoutError("TLS handshake not done in time")
            try:
                conn.do_handshake()
                conn.settimeout(left)
                return conn
            except ssl.SSLWantReadError:
                _wait_ready(conn, selectors.EVENT_READ, left)
            except ssl.SSLWantWriteError:
                _wait_ready(conn, selectors.EVENT_WRITE, left)
            except BaseException:
                conn.close()
                raise

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def _wait_ready(sock: socket.socket, event: int, timeout_s: float) -> None:
    """Until `sock` is readable / writable or `timeout_s` passed (epoll: any fd number)."""
    with selectors.DefaultSelector() as selector:
        selector.register(sock, event)
        selector.select(timeout_s)


class ControlConnection:
    """Receiver side of one control connection; each `call` is one request, one reply."""

    def __init__(self, host: str, port: int, options: TransportOptions, timeout_s: float):
        self.token = options.token
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = client_context(options)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=server_name(options, host))
            except BaseException:
                sock.close()
                raise
        self.sock = sock
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


def responsive(host: str, port: int, options: TransportOptions, timeout_s: float = 1.0) -> bool:
    """Whether the sender still answers a request: tells a dead sender from a dropped
    transfer. A full round trip, because a dying process can still accept a connect."""
    try:
        conn = ControlConnection(host, port, options, timeout_s)
    except OSError:  # ssl.SSLError included
        return False
    try:
        conn.call(Heartbeat("").to_json(), timeout_s)
        return True
    except (ChannelClosed, OSError):
        return False
    finally:
        conn.close()
