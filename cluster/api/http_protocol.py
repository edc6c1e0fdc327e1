"""The HTTP/1.1 connection protocol `pdserve serve` runs uvicorn with: uvicorn's h11
protocol, plus the two bounds a public endpoint needs that uvicorn leaves out.

A connection's life here:
    accepted -> refused at once with a 503 (OpenAI-style JSON) when the server already
      holds `connection_limit` connections, so a flood of idle sockets cannot take
      every file descriptor and task
    -> its request head must arrive within `header_timeout_s` of the connection (or of
       the previous response on a kept-alive connection), else it is closed: a client
       that trickles header bytes (slowloris) holds a connection for that long at most
    -> the request runs as uvicorn runs it (the body's own deadline is the frontend's,
       cluster/api/request_body.py).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from cluster.api.openai_protocol import ApiError


def _busy_response() -> bytes:
    body = json.dumps(
        ApiError(503, "server at its connection limit; retry shortly").body()
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "retry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def bounded_protocol(connection_limit: int, header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these bounds."""

    class BoundedH11Protocol(_BoundedH11Protocol):
        pass

    BoundedH11Protocol.connection_limit = connection_limit
    BoundedH11Protocol.header_timeout_s = header_timeout_s
    return BoundedH11Protocol


class _BoundedH11Protocol(H11Protocol):
    connection_limit: int = 1 << 16
    header_timeout_s: float = 30.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.connection_limit:
            transport.write(_BUSY_RESPONSE)
            transport.close()
            return
        self._arm_header_deadline()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()  # the next request on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _head_too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            _drop(self.transport)

    def shutdown(self) -> None:
        """Called by uvicorn on a graceful shutdown: an idle connection is dropped at
        once, one with a response under way closes after it, as uvicorn does."""
        if self.cycle is None or self.cycle.response_complete:
            self.conn.send(h11.ConnectionClosed())
            _drop(self.transport)
        else:
            self.cycle.keep_alive = False


def _drop(transport) -> None:
    """Close an idle connection without waiting on its client. A TLS transport's
    `close()` waits for the client's close_notify (asyncio's ssl_shutdown_timeout, 30 s),
    and the connection holds its slot and the server's shutdown that long; with nothing
    left to send, an abort ends it now."""
    if transport.get_write_buffer_size() == 0:
        transport.abort()
    else:
        transport.close()


_BUSY_RESPONSE = _busy_response()
