"""`local`: sender and receiver in one process (colocated mode, unit tests).

The sender registers itself in a process-wide table at start; the receiver finds it by
worker id from the ticket and copies the blocks pool to pool, one copy per piece.
Shaping and faults apply in that copy loop, in the receiver's thread.
"""

from __future__ import annotations

import os
import threading
import time

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket, FailureReason, KVTransferError
from kv_transfer.blockio import copy_pieces, flat_bytes, plan_pieces, total_bytes
from kv_transfer.config import TransportOptions
from kv_transfer.endpoints import LocalEndpoint
from kv_transfer.faults import DropTransfer, FaultPlan
from kv_transfer.integrity import BlockVerifier
from kv_transfer.push import ExportGone, FollowedSegments
from kv_transfer.receiver import TransportReceiver, fail, remaining
from kv_transfer.sender import RegistrySender
from kv_transfer.shaping import Shaper

_SENDERS: dict[str, RegistrySender] = {}
_LOCK = threading.Lock()


class LocalServer:
    """Makes a sender findable by in-process receivers."""

    def __init__(self, sender: RegistrySender):
        self.sender = sender
        with _LOCK:
            _SENDERS[sender.worker_id] = sender

    def endpoint(self) -> LocalEndpoint:
        return LocalEndpoint(os.getpid())

    def close(self) -> None:
        with _LOCK:
            if _SENDERS.get(self.sender.worker_id) is self.sender:
                del _SENDERS[self.sender.worker_id]


def make_local_sender(worker_id: str, pool: KVCachePool, options: TransportOptions):
    return RegistrySender("local", worker_id, pool, options, [LocalServer])


class LocalReceiver(TransportReceiver):
    def __init__(self, worker_id: str, pool: KVCachePool, options: TransportOptions):
        super().__init__("local", worker_id, pool, options)

    def _sender(self, ticket: ExportTicket) -> RegistrySender:
        local = ticket.sender_endpoint.local
        if local is None or local.pid != os.getpid():
            raise fail(ticket, FailureReason.INTERNAL, "sender is not in this process")
        with _LOCK:
            sender = _SENDERS.get(ticket.sender_id)
        if sender is None:
            raise fail(ticket, FailureReason.PEER_DIED, "sender is closed")
        return sender

    def _pull(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        deadline: float,
        verifier: BlockVerifier,
    ):
        sender = self._sender(ticket)
        if sender.registry.begin_transfer(ticket.request_id) is None:
            raise fail(ticket, FailureReason.UNKNOWN_REQUEST, "export is gone")
        shaper = Shaper(self.options.bandwidth_bytes_per_s, self.options.added_latency_s)
        chunk = shaper.piece_bytes(self.options.chunk_bytes)
        pieces = plan_pieces(ticket.block_ids, dst_block_ids, self.pool.layout.block_nbytes, chunk)
        faults = FaultPlan(self.options.faults, total_bytes(pieces), ticket.request_id)

        def step(piece) -> bool:
            remaining(deadline, ticket)
            shaper.pace(piece.nbytes)
            return faults.hit(piece.offset, piece.nbytes)

        shaper.start()
        failure: FailureReason | None = FailureReason.INTERNAL
        try:
            copy_pieces(
                flat_bytes(sender.pool.kv), flat_bytes(self.pool.kv), pieces, step, verifier
            )
            shaper.finish()
            failure = None
        except DropTransfer:
            failure = FailureReason.DROPPED
            raise fail(ticket, failure, "transfer dropped") from None
        except KVTransferError as exc:
            failure = exc.reason
            raise
        finally:
            sender.registry.end_transfer(ticket.request_id, total_bytes(pieces), failure)
        return "local"

    def _follow(self, followed: FollowedSegments, timeout_s: float) -> str:
        ticket = followed.ticket
        sender = self._sender(ticket)
        shaper = Shaper(self.options.bandwidth_bytes_per_s, self.options.added_latency_s)
        chunk = shaper.piece_bytes(self.options.chunk_bytes)
        block_nbytes = self.pool.layout.block_nbytes
        src_flat, dst_flat = flat_bytes(sender.pool.kv), flat_bytes(self.pool.kv)
        try:
            for note in sender.pushed(ticket.request_id, followed.first_block):
                deadline = time.monotonic() + timeout_s
                remaining(deadline, ticket)
                if note is None:
                    continue
                segment, dst, verifier, arrived = followed.open(note)
                pieces = plan_pieces(segment.block_ids, dst, block_nbytes, chunk)

                def step(piece, deadline=deadline) -> bool:
                    remaining(deadline, ticket)
                    shaper.pace(piece.nbytes)
                    return False

                shaper.start()
                copy_pieces(src_flat, dst_flat, pieces, step, verifier)
                shaper.finish()
                followed.landed(segment, verifier, arrived)
        except ExportGone:
            raise fail(ticket, FailureReason.UNKNOWN_REQUEST, "export is gone") from None
        followed.ended()
        return "local"

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        return self._sender(ticket).heartbeat(ticket.request_id)
