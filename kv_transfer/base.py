"""The contract between workers and KV transports. Read this before any transport.

Lifecycle of one request's KV, prefill side (sender) to decode side (receiver):

    prefill worker                                decode worker
    --------------                                -------------
    engine finishes the prompt, takes the blocks
    ticket = sender.export(request_id, ...)  ---> ticket (a dataclass, pickled by Ray
      blocks pinned under a lease                  in the call; `to_dict` is its JSON)
                                                  dst = engine.reserve_imports(...), less
                                                    the blocks its prefix cache holds
                                                  result = receiver.fetch(ticket, dst, held)
      (heartbeats extend the lease)  <---------   ... bytes move over the transport ...
    sender.ack(request_id) on success  <-------   result.state == DONE -> engine.finish_import
      blocks come back via poll_released()        on failure: engine.release_blocks(dst)
    lease expiry / abort also release them

Streamed exports (`kv_streaming: chunk`, docs/kv_transfer.md#streamed-exports)
grow the same export a segment at a time: after each prefill chunk the prefill worker
calls `sender.export_segment` with the blocks that chunk completed, and each segment's
ticket (`ExportTicket.segment` set) is pulled on its own while the next chunk computes;
the segment with `final` set carries the rest (the last, partial block) and the
export is then what `export` would have made: one lease, one ack, one release.

Thread-safety rule: transports and the ownership registry never touch a
`BlockAllocator`. Block ids to free come back to the owning worker through
`KVSender.poll_released()`, which the worker's engine loop calls and frees itself.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from engine.kv_cache import KVCachePool, KVLayout
from kv_transfer.endpoints import SenderEndpoint

if TYPE_CHECKING:
    from kv_transfer.stats import ReceiverStats, SenderStats


class TransferState(enum.IntEnum):
    """Ordered: anything below PENDING is terminal failure, DONE is terminal success."""

    FAILED = 0
    ABORTED = 1
    EXPIRED = 2
    PENDING = 3
    TRANSFERRING = 4
    DONE = 5


class FailureReason(str, enum.Enum):
    TIMEOUT = "timeout"
    CHECKSUM = "checksum"
    PEER_DIED = "peer_died"
    LAYOUT_MISMATCH = "layout_mismatch"
    UNKNOWN_REQUEST = "unknown_request"
    UNAUTHORIZED = "unauthorized"
    DROPPED = "dropped"
    CANCELLED = "cancelled"
    """The receiving request was aborted while its bytes were moving."""
    INTERNAL = "internal"


@dataclass(frozen=True)
class StreamSegment:
    """Where a segment of a streamed export sits in the request's blocks."""

    first_block: int
    """Position, in the request's whole block list, of the segment's first block."""
    final: bool = False
    """The last segment: the export is complete, its `num_tokens` the prompt's."""

    def __post_init__(self) -> None:
        if self.first_block < 0:
            raise ValueError(f"a segment starts at block {self.first_block}")


@dataclass(frozen=True)
class ExportTicket:
    """What a receiver needs to pull one request's blocks. Travels inside Ray calls
    (pickled by Ray, never on a wire of ours); `to_dict` / `from_dict` give its JSON."""

    request_id: str
    sender_id: str
    sender_endpoint: SenderEndpoint
    """How to reach the sender, from `KVSender.endpoint()`."""
    layout: KVLayout
    """The sender's pool layout; the receiver refuses a mismatch."""
    block_ids: list[int]
    """Sender-side block ids, in sequence order."""
    num_tokens: int
    """Tokens of KV the blocks hold (the prompt length)."""
    lease_ttl_s: float
    """The sender's `TransportOptions.lease_ttl_s`: a receiver heartbeats within it."""
    checksums: list[int] = field(default_factory=list)
    """One per block, computed at export; verified by the receiver."""
    checksum_algo: str = "crc32"
    """How `checksums` were computed (see kv_transfer/integrity.py)."""
    shards: tuple[ExportTicket, ...] = ()
    """A tensor-parallel sender's other ranks' exports of the same blocks (ranks 1..N-1,
    each with its own endpoint, layout and checksums); this ticket is rank 0's."""
    segment: StreamSegment | None = None
    """Set on a segment of a streamed export: these blocks are the request's blocks
    `segment.first_block` onwards, and `num_tokens` counts the tokens whose KV the
    export holds so far. None: the whole export (what `export` returns)."""

    @property
    def slices(self) -> tuple[ExportTicket, ...]:
        """Every rank's export, rank 0's first, each on its own (no shards)."""
        return (replace(self, shards=()), *self.shards)

    @property
    def nbytes(self) -> int:
        """Bytes of the export over every rank's pool."""
        return sum(s.layout.block_nbytes * len(s.block_ids) for s in self.slices)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one of its blocks over every rank's pool."""
        return sum(s.layout.block_nbytes for s in self.slices)

    def with_shards(self, shards: list[ExportTicket]) -> ExportTicket:
        """This (rank 0's) ticket with the other ranks' exports (the sharded sender)."""
        return replace(self, shards=tuple(shards))

    def to_dict(self) -> dict:
        return asdict(self)

    def tail(self, held_blocks: int) -> ExportTicket:
        """The part of this export (or segment) a receiver still needs when it already
        holds the first `held_blocks` of its blocks (a prefix-cache hit, or a segment's
        leading blocks that the receiver's cache holds)."""
        if not 0 <= held_blocks < len(self.block_ids):
            raise ValueError(f"[request {self.request_id}] cannot skip {held_blocks} blocks")
        segment = self.segment
        if segment is not None:
            segment = replace(segment, first_block=segment.first_block + held_blocks)
        return replace(
            self,
            block_ids=self.block_ids[held_blocks:],
            checksums=self.checksums[held_blocks:],
            shards=tuple(shard.tail(held_blocks) for shard in self.shards),
            segment=segment,
        )

    @property
    def first_block(self) -> int | None:
        """Where a segment's blocks start in the request's export (None: a whole export,
        whose pull names the export's last blocks, `blockio.requested_blocks`)."""
        return None if self.segment is None else self.segment.first_block

    @classmethod
    def from_dict(cls, data: dict) -> ExportTicket:
        segment = data.get("segment")
        return cls(
            **{
                **data,
                "sender_endpoint": SenderEndpoint.from_dict(data["sender_endpoint"]),
                "layout": KVLayout(**data["layout"]),
                "shards": tuple(cls.from_dict(shard) for shard in data.get("shards", ())),
                "segment": StreamSegment(**segment) if segment is not None else None,
            }
        )


@dataclass(frozen=True)
class SliceReceipt:
    """What one head slice of a transfer moved: from which sender rank to which receiver
    rank, which of the model's KV heads, how many bytes (over the wire: a staged slice
    moves the sender rank's whole blocks, its heads then copied in locally), and the
    checksum every one of its blocks was verified with."""

    sender_rank: int
    receiver_rank: int
    first_kv_head: int
    kv_heads: int
    num_bytes: int
    staged: bool
    checksum: str = ""


@dataclass
class TransferResult:
    """Outcome of one fetch, reported by the receiver; failures come back as data."""

    request_id: str
    state: TransferState
    transport: str
    """The transport that actually moved the bytes (never a silent fallback)."""
    num_bytes: int = 0
    seconds: float = 0.0
    reason: FailureReason | None = None
    message: str = ""
    failed_blocks: list[int] = field(default_factory=list)
    checksum: str = ""
    """The algorithm every block was verified with (the ticket's: `xxh3_64` or `crc32`
    on the host, `wsum64` on the device, kv_transfer/integrity.py); empty unless DONE."""
    slices: list[SliceReceipt] = field(default_factory=list)
    """Per head slice moved, where the transfer went between tensor-parallel layouts
    (kv_transfer/resharding.py); empty for a transfer of whole blocks."""

    @property
    def ok(self) -> bool:
        return self.state == TransferState.DONE


class KVTransferError(Exception):
    """A transfer failed; carries the request id, the peer and the reason."""

    def __init__(
        self,
        message: str,
        request_id: str,
        peer: str,
        reason: FailureReason,
        failed_blocks: list[int] | None = None,
    ):
        self.request_id = request_id
        self.peer = peer
        self.reason = reason
        self.failed_blocks = failed_blocks or []
        self.detail = message
        super().__init__(
            f"[request {request_id}] KV transfer with {peer} failed ({reason.value}): {message}"
        )


class KVSender(ABC):
    """Lives in a prefill worker process; one per worker, created at worker start."""

    name: str

    def __init__(self, worker_id: str, pool: KVCachePool):
        self.worker_id = worker_id
        self.pool = pool

    @abstractmethod
    def endpoint(self) -> SenderEndpoint:
        """How a receiver reaches us; put into every ticket."""

    @abstractmethod
    def export(
        self, request_id: str, block_ids: list[int], num_tokens: int, peer_id: str
    ) -> ExportTicket:
        """Called by the prefill worker once per request after prefill; pins the blocks
        under a lease until ack, lease expiry or abort."""

    def export_segment(
        self,
        request_id: str,
        block_ids: list[int],
        first_block: int,
        num_tokens: int,
        peer_id: str,
        final: bool = False,
    ) -> ExportTicket:
        """Called by the prefill worker on its engine thread right after a prefill chunk's
        step (`kv_streaming: chunk`): the blocks that chunk completed (`first_block` is
        the position of `block_ids[0]` among the request's blocks) join the request's
        export, under its lease, from the first segment on; `final` (with the last,
        partial block) completes it. Returns the segment's ticket, which a receiver
        pulls on its own. The caller holds a reference on each block for the export
        (the export frees them, as it frees an `export`'s)."""
        raise NotImplementedError

    def whole_ticket(self, request_id: str) -> ExportTicket:
        """Called by the prefill worker after the final segment: the ticket of the whole
        export, as `export` would have returned it (a re-pull after a decode worker's
        death reads it). Raises KeyError when the export is gone."""
        raise NotImplementedError

    def push_source(self) -> ExportTicket:
        """Called through the prefill worker by the driver, once per worker incarnation
        (`kv_transfer_mode: push`): a ticket of no blocks and no request, naming this
        sender (endpoint, layout, checksum algorithm, lease), from which a receiver opens
        the standing transfer of a request before any of its blocks exist."""
        raise NotImplementedError

    @abstractmethod
    def ack(self, request_id: str) -> None:
        """Called when the receiver reports success; releases the blocks exactly once."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Called when the request is cancelled or its receiver died; releases the blocks."""

    @abstractmethod
    def poll_released(self) -> list[list[int]]:
        """Called by the worker's engine loop; returns block-id lists it must free now."""

    def heartbeat(self, request_id: str) -> bool:
        """Called by the transport's server thread (or the worker) while a receiver is still
        working on `request_id`; extends its lease. False when the export is gone."""
        raise NotImplementedError

    def stats(self) -> SenderStats:
        """Called by the metrics layer whenever it reports; a snapshot of counters."""
        raise NotImplementedError

    def leased_request_ids(self) -> list[str]:
        """Called by the worker's `debug_state`: requests whose blocks are pinned now."""
        raise NotImplementedError

    def at_risk_request_ids(self) -> list[str]:
        """Called by the worker's `debug_state`: pinned requests whose bytes this process's
        death would lose (no receiver pulled them, and they live only in its memory)."""
        return self.leased_request_ids()

    def close(self) -> None:
        """Called once at worker shutdown."""


class KVReceiver(ABC):
    """Lives in a decode worker process; one per worker."""

    name: str

    def __init__(self, worker_id: str, pool: KVCachePool):
        self.worker_id = worker_id
        self.pool = pool

    @abstractmethod
    def fetch(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        timeout_s: float,
        held_blocks: int = 0,
    ) -> TransferResult:
        """Called by the decode worker after reserving `dst_block_ids`; blocks until the
        blocks are written (DONE) or the transfer failed. Never raises for transfer
        failures: they come back as a result with state < PENDING and a reason. On
        failure the caller frees `dst_block_ids`.

        `held_blocks`: the decode side's prefix cache already holds the export's first
        `held_blocks` blocks, so only the others move, one per `dst_block_ids` entry
        (the pull asks for the export's tail: `len(dst_block_ids)` blocks)."""

    def follow(
        self,
        source: ExportTicket,
        request_id: str,
        first_block: int,
        dst_block_ids: list[int],
        timeout_s: float,
        on_segment,
    ) -> TransferResult:
        """Called by the decode worker on a fetch thread once a pushed request's blocks
        are reserved (`kv_transfer_mode: push`, kv_transfer/push.py), before its export
        may exist: opens one standing transfer from `source`'s sender (a
        `KVSender.push_source` ticket) for `request_id`'s export from block position
        `first_block` on, into `dst_block_ids` (its blocks for those positions, in
        order). The sender sends each run of blocks as soon as it is exported; each is
        verified, then `on_segment(segment ticket, arrived, landed, bytes)` is called.
        Returns once the export is complete and every block landed (DONE), or failed
        (as data, like `fetch`; `cancel` applies). On failure the caller frees what it
        reserved, or keeps the segments `on_segment` reported."""
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        """Called by the decode worker when a request is aborted while its fetch runs (on
        any thread): the fetch fails with CANCELLED at its next piece or wait."""
        raise NotImplementedError

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        """Called by the decode worker while a ticket waits (e.g. for free blocks): extends
        the sender's lease through the transport. False when the export is gone."""
        raise NotImplementedError

    def stats(self) -> ReceiverStats:
        """Called by the metrics layer whenever it reports; a snapshot of counters."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once at worker shutdown."""


def check_layout(ticket: ExportTicket, local: KVLayout, peer: str) -> None:
    """Receivers call this first: refuse blocks of another model, dtype or shape."""
    if ticket.layout != local:
        raise KVTransferError(
            f"layout {ticket.layout} does not match local {local}",
            ticket.request_id,
            peer,
            FailureReason.LAYOUT_MISMATCH,
        )
