"""Options of one KV transport instance, fixed when a worker builds its sender or receiver.

A worker reads these from the cluster config once, passes them to `make_sender` /
`make_receiver`, and every transfer that sender or receiver makes obeys them: chunk
size, shaping of the link, lease length, where the servers bind, the cluster token,
TLS, the limits on connections, the default wait, and any faults injected for
experiments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from kv_transfer.listeners import is_loopback

FaultMode = Literal["none", "drop", "stall", "corrupt", "kill"]
ChecksumAlgo = Literal["xxh3_64", "crc32"]
CHECKSUM_ALGOS = ("xxh3_64", "crc32")


@dataclass(frozen=True)
class FaultOptions:
    """One injected fault, applied where the bytes move (see kv_transfer/faults.py)."""

    mode: FaultMode = "none"
    """drop: end the transfer without a word; stall: sleep `stall_s` mid-transfer;
    corrupt: flip a byte in one chunk; kill: `os._exit` the sending process part way."""
    probability: float = 1.0
    """Chance that a given transfer is hit."""
    after_fraction: float = 0.5
    """How far into the transfer (by bytes) the fault strikes."""
    stall_s: float = 30.0
    """How long a stall sleeps; set it past the receiver's timeout."""

    def __post_init__(self) -> None:
        if self.mode not in ("none", "drop", "stall", "corrupt", "kill"):
            raise ValueError(f"unknown fault mode {self.mode!r}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"fault probability must be in [0, 1], got {self.probability}")
        if not 0.0 <= self.after_fraction <= 1.0:
            raise ValueError(f"after_fraction must be in [0, 1], got {self.after_fraction}")
        if self.stall_s < 0:
            raise ValueError(f"stall_s must be >= 0, got {self.stall_s}")


@dataclass(frozen=True)
class TransportOptions:
    """Knobs shared by every transport; each transport ignores the ones it has no use for."""

    chunk_bytes: int = 4 << 20
    """Largest piece of KV moved in one message / send / copy."""
    bandwidth_bytes_per_s: float | None = None
    """Cap of this link in bytes/s (None: as fast as it goes)."""
    added_latency_s: float = 0.0
    """Extra one-way latency added once per transfer before the first byte."""
    lease_ttl_s: float = 30.0
    """How long exported blocks stay pinned without a heartbeat before they are reclaimed."""
    bind_host: str = "127.0.0.1"
    """Address the sender's servers (gRPC, control, the collective transport's TCPStore)
    listen on; loopback by default. Any other address needs a `token`."""
    advertise_host: str | None = None
    """Address peers dial, and the address a gloo pair group binds; defaults to
    `bind_host` (set it when binding 0.0.0.0)."""
    token: str = ""
    """Cluster token every control/gRPC call must carry, checked before the server reads
    more than a small first message; empty disables the check (loopback only)."""
    timeout_s: float = 30.0
    """Bound on every wait (connect, rendezvous, one chunk), and a decode worker's bound
    on one whole fetch."""
    max_message_bytes: int = 64 << 20
    """gRPC max send/receive message size, set on both ends; must exceed `chunk_bytes`."""
    checksum: ChecksumAlgo = "xxh3_64"
    """Per-block checksum of CPU pools: `xxh3_64` (xxhash, tens of GB/s) or `crc32`
    (zlib, ~3 GB/s). Device pools always use `wsum64`, computed on the device."""
    node_id: str | None = None
    """Override of this worker's node identity (tests that pretend to be two nodes)."""
    shm_dir: str = "/dev/shm"
    """Where the `shm` transport puts the sender's pool file."""
    copy_threads: int = 0
    """Threads the `shm` receiver copies (and verifies) pieces with; 0 means this process's
    torch thread count, i.e. the worker's compute budget. One core's copy of cache-sized
    pieces tops out near half a streaming memcpy; two reach the node's bandwidth."""
    tls_certfile: str | None = None
    """PEM certificate (chain) the gRPC server and the control server (`shm`, `collective`)
    present: set, every receiver speaks TLS to them and verifies it. One certificate
    shared by every worker of a cluster is fine (see `tls_server_name`). Receivers are
    not asked for certificates: the token authenticates them, inside TLS. TLS does not
    cover the `collective` transport's TCPStore (pair rendezvous, no token either) nor
    its KV bytes, which gloo/NCCL send in plaintext (they cannot do TLS); `shm` bytes
    never leave the node (shared memory)."""
    tls_keyfile: str | None = None
    """PEM private key of `tls_certfile`; required with it."""
    tls_ca_file: str | None = None
    """PEM CA certificates receivers verify the server's certificate with; None: the
    system's trust store. Only with `tls_certfile`."""
    tls_server_name: str | None = None
    """Name receivers check the server's certificate for (a DNS name in its SAN); None:
    the address they dial, which the certificate must then list (SAN IP) for every
    worker. Set it when one shared certificate serves workers on changing addresses."""
    max_connections: int = 64
    """Most connections a control server serves at once (a new one past it is closed at
    once), and most RPCs the gRPC server holds at once, running or queued (one past it
    is refused RESOURCE_EXHAUSTED)."""
    auth_timeout_s: float = 10.0
    """How long a new control connection may take for its TLS handshake and its first,
    token-carrying message before the server closes it."""
    faults: FaultOptions = field(default_factory=FaultOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer, got {self.chunk_bytes!r}")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        for name in ("added_latency_s",):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("lease_ttl_s", "timeout_s", "auth_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_message_bytes <= self.chunk_bytes:
            raise ValueError(
                f"max_message_bytes ({self.max_message_bytes}) must exceed chunk_bytes "
                f"({self.chunk_bytes}) so one chunk fits one message"
            )
        if not isinstance(self.copy_threads, int) or self.copy_threads < 0:
            raise ValueError(f"copy_threads must be an integer >= 0, got {self.copy_threads!r}")
        if self.checksum not in CHECKSUM_ALGOS:
            raise ValueError(f"unknown checksum {self.checksum!r}")
        if not isinstance(self.faults, FaultOptions):
            raise TypeError("faults must be a FaultOptions")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")
        if not self.token and not is_loopback(self.bind_host):
            raise ValueError(
                f"bind_host {self.bind_host!r} is not a loopback address and the cluster "
                f"token is empty: set a token before serving KV off this host"
            )
        self._check_tls()

    def _check_tls(self) -> None:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together: set both or neither")
        if self.tls_certfile is None and (self.tls_ca_file or self.tls_server_name):
            raise ValueError("tls_ca_file / tls_server_name without tls_certfile: TLS is off")
        for name in ("tls_certfile", "tls_keyfile", "tls_ca_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")

    @property
    def tls_enabled(self) -> bool:
        """Whether control connections and gRPC calls speak TLS."""
        return self.tls_certfile is not None

    @property
    def dial_host(self) -> str:
        """The address peers reach this worker's servers and gloo device at."""
        return self.advertise_host or self.bind_host
