"""The receiver every transport shares: layout check, timing, verification, stats, and
turning every failure into a `TransferResult` (fetch never raises for transfer faults).

Decode worker lifecycle: `make_receiver(...)` at start; per request, reserve blocks,
`fetch(ticket, dst, timeout_s)`, then on DONE tell the sender to ack and add the
request to the engine, on failure free `dst` itself; `keepalive(ticket)` while a ticket
waits for blocks; `stats()` for metrics; `close()` at shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from engine.kv_cache import KVCachePool
from kv_transfer.base import (
    ExportTicket,
    FailureReason,
    KVReceiver,
    KVTransferError,
    TransferResult,
    TransferState,
    check_layout,
)
from kv_transfer.blockio import PoolBytes
from kv_transfer.config import TransportOptions
from kv_transfer.integrity import BlockVerifier
from kv_transfer.push import FollowedSegments
from kv_transfer.stats import ReceiverStats, bump
from kv_transfer.transfer_stream import TransferStream

logger = logging.getLogger(__name__)


CANCEL_MEMORY_S = 600.0
"""How long a cancelled request id is remembered: a cancel that arrives after its fetch
ended (nothing clears it then) is forgotten after this."""
CANCEL_MEMORY_IDS = 4096
"""Most cancelled ids remembered at once; past it the oldest are forgotten first."""


class _Cancellations:
    """Fetches whose request was aborted while their bytes were moving. Every transport
    waits through `remaining`, which fails a cancelled fetch at its next piece or wait,
    so the destination blocks are released within a piece's time, not at the timeout.
    A fetch clears its id when it ends; ids nothing clears age out (`ttl_s`, `max_ids`)."""

    def __init__(
        self,
        ttl_s: float = CANCEL_MEMORY_S,
        max_ids: int = CANCEL_MEMORY_IDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ids: OrderedDict[str, float] = OrderedDict()
        """request id -> when it was cancelled, oldest first."""
        self._ttl_s = ttl_s
        self._max_ids = max_ids
        self._clock = clock
        self._lock = threading.Lock()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            now = self._clock()
            self._ids.pop(request_id, None)
            self._ids[request_id] = now
            self._forget_old(now)

    def _forget_old(self, now: float) -> None:
        while self._ids:
            oldest, since = next(iter(self._ids.items()))
            if len(self._ids) <= self._max_ids and now - since < self._ttl_s:
                return
            del self._ids[oldest]

    def clear(self, request_id: str) -> None:
        with self._lock:
            self._ids.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        since = self._ids.get(request_id)  # one dict read: no lock on the per-piece path
        return since is not None and self._clock() - since < self._ttl_s

    def __len__(self) -> int:
        with self._lock:
            self._forget_old(self._clock())
            return len(self._ids)


CANCELLED_FETCHES = _Cancellations()


class TransportReceiver(KVReceiver):
    """Subclasses implement `_pull`: move the bytes, return the transport that did."""

    def __init__(self, name: str, worker_id: str, pool: KVCachePool, options: TransportOptions):
        super().__init__(worker_id, pool)
        self.name = name
        self.options = options
        self._stats = ReceiverStats()
        self._lock = threading.Lock()
        self._bytes = PoolBytes()
        self._block_nbytes = pool.layout.block_nbytes
        self._stream = TransferStream(pool.kv.device)
        """Device pools: every fetch's copies, receives and checksums run here, off the
        engine's compute stream (kv_transfer/transfer_stream.py)."""

    @abstractmethod
    def _pull(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        deadline: float,
        verifier: BlockVerifier,
    ) -> str:
        """Write the ticket's blocks into `dst_block_ids` by `deadline` (monotonic) or raise
        `KVTransferError`; returns the name of the transport that moved the bytes. Calls
        `verifier.landed(end)` whenever the stream is complete up to `end` (optional:
        the caller verifies the rest, but blocks still in cache are cheaper to sum)."""

    def fetch(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        timeout_s: float,
        held_blocks: int = 0,
    ) -> TransferResult:
        start = time.monotonic()
        result = TransferResult(ticket.request_id, TransferState.FAILED, self.name)
        try:
            ticket = ticket.tail(held_blocks) if held_blocks else ticket
            remaining(start + timeout_s, ticket)
            check_layout(ticket, self.pool.layout, ticket.sender_id)
            if len(dst_block_ids) != len(ticket.block_ids):
                raise KVTransferError(
                    f"{len(dst_block_ids)} destination blocks for {len(ticket.block_ids)}",
                    ticket.request_id,
                    ticket.sender_id,
                    FailureReason.INTERNAL,
                )
            verifier = BlockVerifier(
                self.pool.kv, dst_block_ids, ticket, self._pool_bytes(), self._block_nbytes
            )
            with self._stream.active():
                try:
                    result.transport = self._pull(
                        ticket, dst_block_ids, start + timeout_s, verifier
                    )
                    verifier.finish()
                finally:
                    self._drain(ticket)
            result.checksum = ticket.checksum_algo
            result.state = TransferState.DONE
            result.num_bytes = len(dst_block_ids) * self.pool.layout.block_nbytes
        except KVTransferError as exc:
            result.reason, result.message = exc.reason, str(exc)
            result.failed_blocks = exc.failed_blocks
        except Exception as exc:  # a bug must not take the decode loop down with it
            logger.exception("[request %s] KV fetch crashed", ticket.request_id)
            result.reason, result.message = FailureReason.INTERNAL, repr(exc)
        finally:
            CANCELLED_FETCHES.clear(ticket.request_id)
        result.seconds = time.monotonic() - start
        self._count(result)
        return result

    def follow(
        self,
        source: ExportTicket,
        request_id: str,
        first_block: int,
        dst_block_ids: list[int],
        timeout_s: float,
        on_segment,
    ) -> TransferResult:
        start = time.monotonic()
        ticket = replace(source, request_id=request_id)
        result = TransferResult(request_id, TransferState.FAILED, self.name)
        try:
            check_layout(ticket, self.pool.layout, ticket.sender_id)
            followed = FollowedSegments(
                ticket,
                first_block,
                list(dst_block_ids),
                self._block_nbytes,
                on_segment,
                lambda dst, segment: BlockVerifier(
                    self.pool.kv, dst, segment, self._pool_bytes(), self._block_nbytes
                ),
            )
            with self._stream.active():
                try:
                    result.transport = self._follow(followed, timeout_s)
                finally:
                    self._drain(ticket)
            result.checksum = ticket.checksum_algo
            result.state = TransferState.DONE
            result.num_bytes = followed.num_bytes
        except KVTransferError as exc:
            result.reason, result.message = exc.reason, str(exc)
            result.failed_blocks = exc.failed_blocks
        except Exception as exc:  # a bug must not take the decode loop down with it
            logger.exception("[request %s] KV follow crashed", request_id)
            result.reason, result.message = FailureReason.INTERNAL, repr(exc)
        finally:
            CANCELLED_FETCHES.clear(request_id)
        result.seconds = time.monotonic() - start
        self._count(result)
        return result

    def _follow(self, followed: FollowedSegments, timeout_s: float) -> str:
        """Open the standing transfer of `followed.ticket`'s request and land each segment
        the sender pushes (`followed.open`, then the bytes, then `followed.landed`) until
        the final one; waits at most `timeout_s` for each message (the sender's `Waiting`
        notes come far more often) and fails CANCELLED at the next one after a cancel.
        Returns the name of the transport that moved the bytes."""
        raise fail(followed.ticket, FailureReason.INTERNAL, f"{self.name} cannot push")

    def _drain(self, ticket: ExportTicket) -> None:
        """Wait for what the fetch queued on the transfer stream (device pools): the
        caller reads, or frees, the destination blocks next."""
        if not self._stream.wait_done(self.options.timeout_s):
            logger.error(
                "[request %s] device work of a KV fetch from %s still pending after %.0fs",
                ticket.request_id,
                ticket.sender_id,
                self.options.timeout_s,
            )

    def _pool_bytes(self):
        """Our CPU pool as one uint8 numpy array (None on a device), made once per storage."""
        return self._bytes.views(self.pool.kv)[1]

    def cancel(self, request_id: str) -> None:
        CANCELLED_FETCHES.cancel(request_id)

    def _count(self, result: TransferResult) -> None:
        with self._lock:
            self._stats.fetches += 1
            if result.ok:
                self._stats.transfers_ok += 1
                self._stats.bytes_received += result.num_bytes
                self._stats.seconds += result.seconds
                bump(self._stats.by_transport, result.transport)
            else:
                bump(self._stats.failures, result.reason.value)
                logger.warning("%s", result.message)

    def stats(self) -> ReceiverStats:
        with self._lock:
            return replace(
                self._stats,
                failures=dict(self._stats.failures),
                by_transport=dict(self._stats.by_transport),
            )


def remaining(deadline: float, ticket: ExportTicket) -> float:
    """Seconds left before `deadline`; raises TIMEOUT when none are, CANCELLED when the
    request's fetch was cancelled."""
    if ticket.request_id in CANCELLED_FETCHES:
        raise KVTransferError(
            "cancelled: the request was aborted",
            ticket.request_id,
            ticket.sender_id,
            FailureReason.CANCELLED,
        )
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVTransferError(
            "timed out", ticket.request_id, ticket.sender_id, FailureReason.TIMEOUT
        )
    return left


def fail(ticket: ExportTicket, reason: FailureReason, message: str) -> KVTransferError:
    return KVTransferError(message, ticket.request_id, ticket.sender_id, reason)
