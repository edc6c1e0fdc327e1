"""TLS contexts of the control channel (`kv_transfer/control.py`), built from the
`tls_*` fields of `TransportOptions`.

A control server builds its context once at sender start (`server_context`); each
receiver connection wraps its socket with `client_context`, made once per CA file.
The gRPC transport builds its own credentials from the same files (`read_pem`).
Receivers verify the server's certificate against `tls_ca_file` (or the system's trust
store) and check it names `tls_server_name`, or the address they dialled.
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

from kv_transfer.config import TransportOptions


def read_pem(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_context(options: TransportOptions) -> ssl.SSLContext | None:
    """The context a control server wraps accepted sockets in; None without TLS."""
    if not options.tls_enabled:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(options.tls_certfile, options.tls_keyfile)
    return context


@functools.lru_cache(maxsize=8)
def _client_context(ca_file: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def client_context(options: TransportOptions) -> ssl.SSLContext | None:
    """The context a receiver wraps its control connections in; None without TLS."""
    return _client_context(options.tls_ca_file) if options.tls_enabled else None


def server_name(options: TransportOptions, dialled_host: str) -> str:
    """The name a receiver checks the sender's certificate against."""
    return options.tls_server_name or dialled_host
