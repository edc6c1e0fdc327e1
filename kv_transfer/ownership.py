"""Who owns exported KV blocks, and until when: the sender-side export registry.

Lifecycle of one export:

    export()            -> PENDING      blocks pinned, lease = now + ttl
    begin_transfer()    -> TRANSFERRING a transport started moving the bytes
    heartbeat()            (any state)  lease = now + ttl (receiver still working)
    end_transfer(ok)    -> PENDING      bytes moved (or failed); waiting for ack/retry
    ack()               -> DONE         blocks released
    abort()             -> ABORTED      blocks released
    reap() past lease   -> EXPIRED      blocks released

A streamed export (`add_segment`) is PENDING from its first segment on and grows with
each one under the same lease (every segment extends it) until its final segment
makes it `complete`; ack, abort and expiry release whatever it holds by then. Server
threads that push segments as they come (`kv_transfer_mode: push`) wait for them in
`wait_for_blocks`.

Release happens exactly once per export: the record leaves the table under the lock
and its block ids go onto a queue the owning worker drains with `poll_released()`;
this module never frees blocks itself (the engine's allocator is not thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Protocol

from kv_transfer.base import FailureReason, TransferState
from kv_transfer.stats import SenderStats, bump

logger = logging.getLogger(__name__)

GONE_IDS_KEPT = 4096
"""Released request ids an `ExportRegistry` remembers for pushers (`released`)."""


@dataclass
class ExportRecord:
    """One request's pinned blocks on the sender."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    owner: str
    peer: str
    checksums: list[int]
    state: TransferState
    lease_expires_at: float
    served: bool = False
    """A transfer of its bytes completed (the blocks stay pinned until ack, so that a
    receiver that dies can pull them again)."""
    complete: bool = True
    """False while a streamed export still waits for segments (`add_segment`)."""


class ExportListener(Protocol):
    """Mirrors the registry elsewhere (the `shm` transport's shared-memory table). Called
    under the registry's lock, so it sees each export's changes in their order."""

    def published(self, record: ExportRecord) -> None:
        """A new export pins `record.block_ids` until `record.lease_expires_at`."""

    def extended(self, record: ExportRecord) -> None:
        """The export's lease now ends at `record.lease_expires_at`."""

    def withdrawn(self, record: ExportRecord) -> int:
        """The export is released (its blocks are not yet reused); returns the bytes of it
        that receivers moved without a `begin_transfer` (counted as served here)."""


class ExportRegistry:
    """Thread-safe table of exports; transports' server threads and the worker share it."""

    def __init__(self, owner: str, lease_ttl_s: float, reap_interval_s: float | None = None):
        self.owner = owner
        self.lease_ttl_s = lease_ttl_s
        self._records: dict[str, ExportRecord] = {}
        self._released: list[list[int]] = []
        self._stats = SenderStats()
        self._lock = threading.Lock()
        self._grown = threading.Condition(self._lock)
        """Notified when a streamed export gains blocks or any export is released."""
        self._gone: OrderedDict[str, None] = OrderedDict()
        """Request ids released lately, oldest first (`released`)."""
        self._listeners: list[ExportListener] = []
        self._stop = threading.Event()
        interval = reap_interval_s or min(max(lease_ttl_s / 4, 0.01), 1.0)
        self._reaper = threading.Thread(
            target=self._reap_loop, args=(interval,), name=f"kv-lease-reaper-{owner}", daemon=True
        )
        self._reaper.start()

    def listen(self, listener: ExportListener) -> None:
        """Called by a transport server at sender start, before any export."""
        with self._lock:
            self._listeners.append(listener)

    # --- called by the worker (through KVSender) -----------------------------------

    def add(
        self, request_id: str, block_ids: list[int], num_tokens: int, peer: str, checksums
    ) -> ExportRecord:
        """Pin `block_ids` for `peer` under a fresh lease; a duplicate id is a caller bug."""
        with self._lock:
            if request_id in self._records:
                raise ValueError(f"[request {request_id}] already exported")
            record = ExportRecord(
                request_id=request_id,
                block_ids=list(block_ids),
                num_tokens=num_tokens,
                owner=self.owner,
                peer=peer,
                checksums=list(checksums),
                state=TransferState.PENDING,
                lease_expires_at=time.monotonic() + self.lease_ttl_s,
            )
            self._records[request_id] = record
            self._gone.pop(request_id, None)
            self._stats.exports += 1
            for listener in self._listeners:
                listener.published(record)
            return replace(record)

    def add_segment(
        self,
        request_id: str,
        block_ids: list[int],
        first_block: int,
        num_tokens: int,
        peer: str,
        checksums,
        final: bool,
    ) -> ExportRecord:
        """A streamed export's next segment: `block_ids` become its blocks `first_block`
        onwards (the first segment, at 0, creates the export); the lease is extended;
        `final` completes it. Segments come in order: anything else is a caller bug."""
        with self._lock:
            record = self._records.get(request_id)
            have = 0 if record is None else len(record.block_ids)
            if first_block != have or (record is not None and record.complete):
                raise ValueError(
                    f"[request {request_id}] segment at block {first_block}, export holds "
                    f"{have}" + (" and is complete" if record is not None else "")
                )
            if record is None:
                record = ExportRecord(
                    request_id=request_id,
                    block_ids=[],
                    num_tokens=0,
                    owner=self.owner,
                    peer=peer,
                    checksums=[],
                    state=TransferState.PENDING,
                    lease_expires_at=0.0,
                    complete=False,
                )
                self._records[request_id] = record
                self._gone.pop(request_id, None)
                self._stats.exports += 1
            # New lists: copies handed out earlier (`begin_transfer`, `get`) share the old.
            record.block_ids = record.block_ids + list(block_ids)
            record.checksums = record.checksums + list(checksums)
            record.num_tokens = num_tokens
            record.complete = final
            record.lease_expires_at = time.monotonic() + self.lease_ttl_s
            added = replace(record, block_ids=list(block_ids))
            for listener in self._listeners:
                listener.published(added)  # the new blocks only; the others keep their rows
                listener.extended(record)
            self._grown.notify_all()
            return replace(record)

    def wait_for_blocks(self, request_id: str, have: int, timeout_s: float) -> ExportRecord | None:
        """Called by a server thread pushing a streamed export: waits until the export
        holds more than `have` blocks or is complete (or `timeout_s` passed), and
        returns a copy of it then; None while it does not exist (not yet, or no more:
        `released`)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                record = self._records.get(request_id)
                left = deadline - time.monotonic()
                if record is None and (left <= 0 or request_id in self._gone):
                    return None
                if record is not None and (
                    len(record.block_ids) > have or record.complete or left <= 0
                ):
                    return replace(record)
                self._grown.wait(left)

    def released(self, request_id: str) -> bool:
        """Whether `request_id`'s export was released lately (acked, aborted, expired):
        a pusher waiting for an export that does not exist yet tells it from one that is
        gone by this (the last `GONE_IDS_KEPT` releases are remembered)."""
        with self._lock:
            return request_id in self._gone

    def ack(self, request_id: str) -> bool:
        """Receiver has the blocks: release them. False when already released (late ack)."""
        return self._release(request_id, TransferState.DONE) is not None

    def abort(self, request_id: str) -> bool:
        return self._release(request_id, TransferState.ABORTED) is not None

    def poll_released(self) -> list[list[int]]:
        """Drain block lists released since the last call; also reaps expired leases."""
        self.reap()
        with self._lock:
            released, self._released = self._released, []
        return released

    def stats(self) -> SenderStats:
        with self._lock:
            snapshot = replace(self._stats, failures=dict(self._stats.failures))
            snapshot.pinned_requests = len(self._records)
            snapshot.pinned_blocks = sum(len(r.block_ids) for r in self._records.values())
        return snapshot

    # --- called by transport server threads ----------------------------------------

    def heartbeat(self, request_id: str) -> bool:
        """Extend the lease; False when the export is gone (acked, aborted or expired)."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None:
                return False
            self._extend(record)
            self._stats.heartbeats += 1
            return True

    def begin_transfer(self, request_id: str) -> ExportRecord | None:
        """Mark TRANSFERRING and extend the lease; returns a copy, or None if unknown."""
        with self._lock:
            record = self._records.get(request_id)
            if record is None:
                return None
            record.state = TransferState.TRANSFERRING
            self._extend(record)
            return replace(record)

    def end_transfer(
        self, request_id: str, num_bytes: int, failure: FailureReason | None = None
    ) -> None:
        """Bytes moved (or not); the blocks stay pinned until ack, abort or expiry."""
        with self._lock:
            if failure is None:
                self._stats.transfers_served += 1
                self._stats.bytes_sent += num_bytes
            else:
                bump(self._stats.failures, failure.value)
            record = self._records.get(request_id)
            if record is not None and failure is None:
                record.served = True
            if record is not None and record.state == TransferState.TRANSFERRING:
                record.state = TransferState.PENDING

    def request_ids(self) -> list[str]:
        """Requests whose blocks are pinned right now (leak checks, `/admin/workers`)."""
        with self._lock:
            return list(self._records)

    def unserved_request_ids(self) -> list[str]:
        """Pinned requests whose bytes no receiver has pulled yet: what a sender's death
        costs (drills pick a victim by these, not by every lease)."""
        with self._lock:
            return [rid for rid, record in self._records.items() if not record.served]

    def get(self, request_id: str) -> ExportRecord | None:
        with self._lock:
            record = self._records.get(request_id)
            return None if record is None else replace(record)

    # --- leases ---------------------------------------------------------------------

    def reap(self) -> int:
        """Release every export whose lease ran out; returns how many."""
        now = time.monotonic()
        with self._lock:
            expired = [r.request_id for r in self._records.values() if r.lease_expires_at < now]
        released = [rid for rid in expired if self._release(rid, TransferState.EXPIRED)]
        for request_id in released:
            logger.warning("[request %s] KV export lease expired without ack", request_id)
        return len(released)

    def close(self) -> None:
        """Stop the reaper; pinned exports stay in the table (the worker is going away)."""
        self._stop.set()
        self._reaper.join(timeout=2.0)

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.reap()

    def _extend(self, record: ExportRecord) -> None:
        record.lease_expires_at = time.monotonic() + self.lease_ttl_s
        for listener in self._listeners:
            listener.extended(record)

    def _release(self, request_id: str, final: TransferState) -> ExportRecord | None:
        with self._lock:
            record = self._records.pop(request_id, None)
            if record is None:
                return None
            record.state = final
            copied = sum(listener.withdrawn(record) for listener in self._listeners)
            if copied and not record.served:
                self._stats.transfers_served += 1
                self._stats.bytes_sent += copied
            self._released.append(record.block_ids)
            self._gone[request_id] = None
            while len(self._gone) > GONE_IDS_KEPT:
                self._gone.popitem(last=False)
            self._grown.notify_all()
            if final == TransferState.DONE:
                self._stats.acks += 1
            elif final == TransferState.ABORTED:
                self._stats.aborts += 1
            else:
                self._stats.expiries += 1
            return record
