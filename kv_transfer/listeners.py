"""Where a sender's servers listen, and whether that address is reachable off the host.

`TransportOptions` asks `is_loopback` when it is built (a listener off loopback needs a
cluster token); the control server and the collective transport's rendezvous store
call `bind_listener` at sender start, so that each listens on `bind_host` only.
"""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether `host` names this host's loopback interface only (127.0.0.0/8, ::1 or
    `localhost`); the unspecified addresses 0.0.0.0 and :: are every interface."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def bind_listener(host: str, backlog: int = 64) -> socket.socket:
    """A TCP socket listening on `host` (IPv4 or IPv6 address, or a name) at a free port;
    `::` takes IPv4 as well, as 0.0.0.0 does for IPv4 alone."""
    family, _, _, _, address = socket.getaddrinfo(
        host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    dualstack = host == "::" and socket.has_dualstack_ipv6()
    return socket.create_server(
        address[:2], family=family, backlog=backlog, dualstack_ipv6=dualstack
    )
