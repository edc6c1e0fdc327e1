"""Options of one KV transport instance, fixed when a worker builds its sender or receiver.

A worker reads these from the cluster config once, passes them to `make_sender` /
`make_receiver`, and every transfer that sender or receiver makes obeys them: chunk
size, shaping of the link, lease length, where the servers bind, the cluster token,
the default wait, and any faults injected for experiments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
    """Address the sender's servers (gRPC, control, TCPStore) bind to; loopback by default."""
    advertise_host: str | None = None
    """Address peers dial; defaults to `bind_host` (set it when binding 0.0.0.0)."""
    token: str = ""
    """Cluster token every control/gRPC call must carry; empty disables the check (tests)."""
    timeout_s: float = 30.0
    """Default bound on every wait (connect, rendezvous, one chunk)."""
    max_message_bytes: int = 64 << 20
    """gRPC max send/receive message size, set on both ends; must exceed `chunk_bytes`."""
    checksum: ChecksumAlgo = "xxh3_64"
    """Per-block checksum: `xxh3_64` (xxhash, tens of GB/s) or `crc32` (zlib, ~3 GB/s)."""
    node_id: str | None = None
    """Override of this worker's node identity (tests that pretend to be two nodes)."""
    shm_dir: str = "/dev/shm"
    """Where the `shm` transport puts the sender's pool file."""
    copy_threads: int = 0
    """Threads the `shm` receiver copies (and verifies) pieces with; 0 means this process's
    torch thread count, i.e. the worker's compute budget. One core's copy of cache-sized
    pieces tops out near half a streaming memcpy; two reach the node's bandwidth."""
    faults: FaultOptions = field(default_factory=FaultOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive integer, got {self.chunk_bytes!r}")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        for name in ("added_latency_s",):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("lease_ttl_s", "timeout_s"):
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

    @property
    def dial_host(self) -> str:
        return self.advertise_host or self.bind_host
