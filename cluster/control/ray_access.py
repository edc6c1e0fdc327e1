"""Who can reach the Ray cluster pdserve runs on.

The private head that `start_local_head` starts: only this host's loopback, and only
with this process's token. A local head serves one driver on one machine: its GCS,
raylet, agents and the worker processes' gRPC servers only ever talk to each other. Yet
a plain `ray.init()` binds them to the host's routable address or to every interface,
and Ray runs any code that any caller sends it. So:

  * every Ray listener binds loopback, whatever `--host` the HTTP server binds: a
    server on the network needs no Ray port on it. `ray.init` replaces a loopback
    `_node_ip_address` with the routable one unless Ray takes the host for one that
    cannot be part of a cluster (`ray_constants.ENABLE_RAY_CLUSTER`, false on macOS and
    Windows), so that flag is cleared while the head starts. With the node's address
    on loopback Ray binds its GCS, raylet, agents, metrics ports and every core worker's
    gRPC server there (tests/test_listeners.py lists them);
  * Ray's token authentication is on (`RAY_AUTH_MODE=token`), against the other users
    and containers of the host that share its loopback. The token is generated per
    server process and handed to Ray's processes in their environment
    (`RAY_AUTH_TOKEN`): nothing is written to `~/.ray/auth_token`, which Ray's own
    default writes and which a read-only home refuses. An operator's own
    `RAY_AUTH_MODE`, `RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH` is kept (set one of the
    latter to reach the head with Ray's CLI).

A joined cluster (`--address`) is the operator's to secure (docs/operations.md): joining
one that took this driver without a token gets a warning.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
from collections.abc import Iterator

import ray

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_MODE = "token"


def require_token_auth() -> None:
    """Called by `start_local_head` before each `ray.init`, in the driver: the processes
    the head starts inherit this environment."""
    mode = os.environ.setdefault(AUTH_MODE_ENV, TOKEN_MODE)
    if mode.lower() != TOKEN_MODE:
        logger.warning(
            "%s=%s: the local Ray head runs without token authentication; any process on "
            "this host can run code in it",
            AUTH_MODE_ENV,
            mode,
        )
    elif not (os.environ.get(AUTH_TOKEN_ENV) or os.environ.get(AUTH_TOKEN_PATH_ENV)):
        os.environ[AUTH_TOKEN_ENV] = secrets.token_hex(32)
    reload_auth_settings()


def reload_auth_settings() -> None:
    """Makes this process's Ray read `RAY_AUTH_*` from the environment again: it reads
    its mode once and caches the token it loaded, so a change of either after that is
    otherwise not seen (`require_token_auth`, and tests that switch modes, call it)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def loopback_node_address() -> Iterator[dict]:
    """Wraps `start_local_head`'s `ray.init`, whose keyword arguments it yields: the
    node's address on loopback, kept there by Ray's own single-host switch."""
    constants = ray._private.ray_constants
    cluster_capable = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield {"_node_ip_address": LOOPBACK}
    finally:
        constants.ENABLE_RAY_CLUSTER = cluster_capable
    node_address = ray._private.worker._global_node.node_ip_address
    if not is_loopback(node_address):
        logger.warning(
            "this Ray version put the local head on %s, not on loopback: its ports are "
            "reachable from the network (token authentication still applies)",
            node_address,
        )


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 and ::1, also as an IPv4-mapped IPv6 address (`::ffff:127.0.0.1`,
    where Ray's gRPC servers bind a dual-stack socket)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def warn_if_joined_without_token(address: str) -> None:
    """Called by the controller after `ray.init(address=...)` joined a cluster. A driver
    not in token mode sends no token, so a cluster that let it in enforces none."""
    if os.environ.get(AUTH_MODE_ENV, "").lower() != TOKEN_MODE:
        logger.warning(
            "joined the Ray cluster at %s, which requires no token: anyone who can reach "
            "its ports can run code on it; start it with %s=token (docs/operations.md)",
            address,
            AUTH_MODE_ENV,
        )
