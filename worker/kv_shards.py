"""KV transfer on a tensor-parallel worker: every rank moves its own heads' KV.

Each rank has a transport of its own over its own pool (a follower builds its own at
start, `follower_transport`). Rank 0's worker code keeps calling one sender or one
receiver as on any worker; these wrap rank 0's and fan each call out to the followers
(Ray calls), so that every rank exports, releases, fetches or cancels the same blocks:

    prefill: `ShardedSender.export` -> each follower exports the blocks from its pool
             (its checksums, its lease) -> rank 0 exports its own last -> one ticket,
             rank 0's, carrying the others (`ExportTicket.shards`); ack and abort go to
             every rank. Rank 0's lease decides when the blocks are free: only rank 0
             has an allocator.
    decode:  `ShardedReceiver.fetch` -> every rank pulls its heads of the export from
             whichever sender ranks hold them (`ReshardingReceiver`), at once ->
             the import is done when every rank's is, and its receipt lists every
             rank's slices.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from engine.block_manager import blocks_needed
from engine.kv_cache import KVCachePool
from kv_transfer.base import (
    ExportTicket,
    FailureReason,
    KVReceiver,
    KVSender,
    TransferResult,
    TransferState,
)
from kv_transfer.registry import make_receiver, make_sender
from kv_transfer.resharding import ReshardingReceiver
from worker.health import node_ip
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 30.0
"""How long rank 0 waits for its followers' exports before the request fails."""
RESULT_MARGIN_S = 10.0
"""A follower's fetch result may come this much after its own timeout (the Ray call)."""


def rank_id(worker_id: str, rank: int) -> str:
    """The transport id of rank `rank` of a worker (rank 0 keeps the worker's own)."""
    return worker_id if rank == 0 else f"{worker_id}.rank{rank}"


def make_rank_receiver(spec: WorkerSpec, rank: int, pool: KVCachePool, max_model_len: int):
    """A decode rank's receiver: whole blocks into `pool`, or head slices through
    staging pools of the sender ranks' layouts (kv_transfer/resharding.py)."""
    options = spec.transport_options_on(node_ip())

    def make(name: str, into: KVCachePool) -> KVReceiver:
        return make_receiver(spec.transport, name, into, options)

    staging = blocks_needed(max_model_len, pool.block_size)
    return ReshardingReceiver(make(rank_id(spec.worker_id, rank), pool), make, staging)


def make_rank_sender(spec: WorkerSpec, rank: int, pool: KVCachePool) -> KVSender:
    return make_sender(
        spec.transport, rank_id(spec.worker_id, rank), pool, spec.transport_options_on(node_ip())
    )


class ShardedSender(KVSender):
    """Rank 0's sender of a tensor-parallel prefill worker."""

    def __init__(self, own: KVSender, followers: list):
        super().__init__(own.worker_id, own.pool)
        self.name = own.name
        self.own = own
        self.followers = followers

    def endpoint(self):
        return self.own.endpoint()

    def export(
        self, request_id: str, block_ids: list[int], num_tokens: int, peer_id: str
    ) -> ExportTicket:
        """Followers first: a failure then leaves nothing pinned that rank 0's engine would
        free a second time (it frees the blocks itself when `export` raises)."""
        calls = [
            f.export.remote(request_id, block_ids, num_tokens, peer_id) for f in self.followers
        ]
        try:
            shards = ray.get(calls, timeout=EXPORT_TIMEOUT_S)
            ticket = self.own.export(request_id, block_ids, num_tokens, peer_id)
        except Exception:
            for follower in self.followers:
                follower.abort.remote(request_id)
            raise
        return ticket.with_shards(shards)

    def ack(self, request_id: str) -> None:
        self.own.ack(request_id)
        for follower in self.followers:
            follower.ack.remote(request_id)

    def abort(self, request_id: str) -> None:
        self.own.abort(request_id)
        for follower in self.followers:
            follower.abort.remote(request_id)

    def poll_released(self) -> list[list[int]]:
        return self.own.poll_released()

    def heartbeat(self, request_id: str) -> bool:
        return self.own.heartbeat(request_id)

    def stats(self):
        return self.own.stats()

    def leased_request_ids(self) -> list[str]:
        return self.own.leased_request_ids()

    def at_risk_request_ids(self) -> list[str]:
        return self.own.at_risk_request_ids()

    async def follower_leases(self) -> list[list[str]]:
        """Each follower's pinned exports (leak checks: every rank's must end empty)."""
        return list(await asyncio.gather(*(f.leases.remote() for f in self.followers)))

    def close(self) -> None:
        self.own.close()


class ShardedReceiver(KVReceiver):
    """Rank 0's receiver of a tensor-parallel decode worker."""

    def __init__(self, own: KVReceiver, followers: list):
        super().__init__(own.worker_id, own.pool)
        self.name = own.name
        self.own = own
        self.followers = followers

    def fetch(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        timeout_s: float,
        held_blocks: int = 0,
    ) -> TransferResult:
        """Every rank pulls its heads at once; done when all are. On failure the caller
        frees (or recomputes into) the blocks on every rank alike, as on one rank."""
        calls = [
            f.fetch.remote(ticket, dst_block_ids, timeout_s, held_blocks) for f in self.followers
        ]
        mine = self.own.fetch(ticket, dst_block_ids, timeout_s, held_blocks)
        try:
            theirs = ray.get(calls, timeout=timeout_s + RESULT_MARGIN_S)
        except Exception as exc:  # a follower died or hung: the worker is going down
            for follower in self.followers:
                follower.cancel.remote(ticket.request_id)
            failed = TransferResult(ticket.request_id, TransferState.FAILED, self.name)
            failed.reason, failed.message = FailureReason.PEER_DIED, f"a rank's fetch: {exc!r}"
            theirs = [failed]
        return combined(mine, theirs)

    def cancel(self, request_id: str) -> None:
        self.own.cancel(request_id)
        for follower in self.followers:
            follower.cancel.remote(request_id)

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        return self.own.keepalive(ticket, timeout_s)

    def stats(self):
        return self.own.stats()

    def close(self) -> None:
        self.own.close()


def combined(mine: TransferResult, theirs: list[TransferResult]) -> TransferResult:
    """One import's result from every rank's: DONE when all are, the first failure
    otherwise; bytes summed, the slowest rank's time, every rank's slices."""
    results = [mine, *theirs]
    failed = next((r for r in results if not r.ok), None)
    out = TransferResult(mine.request_id, TransferState.DONE, mine.transport)
    out.num_bytes = sum(r.num_bytes for r in results)
    out.seconds = max(r.seconds for r in results)
    out.checksum = mine.checksum
    out.slices = [s for r in results for s in r.slices]
    if failed is not None:
        out.state, out.reason, out.message = failed.state, failed.reason, failed.message
        out.failed_blocks = failed.failed_blocks
    return out
