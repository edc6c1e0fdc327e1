"""Plain counters a worker reads from its sender or receiver for the metrics layer.

The prefill worker calls `sender.stats()`, the decode worker `receiver.stats()`, each
whenever it reports; the process that owns Prometheus turns these into
`pdserve_kv_transfer_*` series. Snapshots are copies: mutating one changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SenderStats:
    """Counters of one `KVSender` since it started."""

    exports: int = 0
    acks: int = 0
    expiries: int = 0
    aborts: int = 0
    heartbeats: int = 0
    transfers_served: int = 0
    bytes_sent: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """Transfers this side saw fail, by `FailureReason` value."""
    pinned_requests: int = 0
    """Exports still holding blocks (a gauge, not a counter)."""
    pinned_blocks: int = 0


@dataclass
class ReceiverStats:
    """Counters of one `KVReceiver` since it started."""

    fetches: int = 0
    transfers_ok: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    """Wall time spent in successful fetches."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed fetches, by `FailureReason` value."""
    by_transport: dict[str, int] = field(default_factory=dict)
    """Successful fetches by the transport that actually moved the bytes."""


def bump(counter: dict[str, int], key: str, by: int = 1) -> None:
    """Increment one keyed counter in place (keys appear on first use)."""
    counter[key] = counter.get(key, 0) + by
