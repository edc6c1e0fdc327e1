"""A follower rank of a tensor-parallel worker: a small Ray actor of its own process.

Lifecycle: started by its worker's rank 0 (`TPRanks`) in bundle `rank` of the worker's
placement group -> its constructor joins the worker's TP group on rank 0's store and
builds its shard of the model and its KV pool (`FollowerEngine`), then runs rank 0's
steps on a thread of its own until rank 0 sends STOP or a peer dies. Rank 0 checks it
in every health check (`check_health`) and watches its death (`wait_until_stopped`):
a follower's death is the worker's death. Its process dies with rank 0 (Ray kills the
actors an actor owns when it dies) and with its placement group.

KV: each follower has its own transport, over its own pool, and rank 0 asks it
(worker/kv_shards.py) to export, release, fetch or cancel the same blocks it does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from engine.cpu_affinity import pin_process
from engine.parallel.follower import FollowerEngine
from engine.parallel.group import TPGroup
from kv_transfer.base import ExportTicket, TransferResult
from worker.kv_shards import make_rank_receiver, make_rank_sender
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankReport:
    """A follower's answer to rank 0's health check."""

    rank: int
    pid: int
    steps: int
    weight_bytes: int
    kv_bytes: int


@dataclass(frozen=True)
class GroupAddress:
    """Where a worker's ranks meet: rank 0's store (loopback: the ranks share a node)
    and the prefix its group's keys live under."""

    host: str
    port: int
    prefix: str


class RankFollower:
    """Rank `rank` > 0 of the worker `spec.worker_id`."""

    def __init__(self, spec: WorkerSpec, rank: int, address: GroupAddress):
        if spec.cpu_cores is not None:
            pin_process(spec.cpu_cores)
        self.spec = spec
        self.rank = rank
        store = dist.TCPStore(
            address.host, address.port, None, False, timedelta(seconds=STORE_TIMEOUT_S)
        )
        self.tp = TPGroup.join(
            dist.PrefixStore(address.prefix, store), rank, spec.tp_size, spec.device
        )
        self.engine = FollowerEngine(spec.engine, self.tp)
        self.sender = self.receiver = None
        """This rank's KV transport: a sender on a prefill worker, a receiver on a
        decode worker (none on a colocated one), over this rank's pool."""
        if spec.role == "prefill":
            self.sender = make_rank_sender(spec, rank, self.engine.kv_pool)
        elif spec.role == "decode":
            pool, longest = self.engine.kv_pool, self.engine.max_model_len
            self.receiver = make_rank_receiver(spec, rank, pool, longest)
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name=f"tp-rank-{rank}", daemon=True)
        self.thread.start()
        self.stopped: asyncio.Event | None = None

    def _serve(self) -> None:
        try:
            self.engine.serve()
        except BaseException as exc:  # a peer died: the worker is dead as a whole
            self.failure = exc
            logger.error("%s rank %d: step failed: %r", self.spec.worker_id, self.rank, exc)

    async def check_health(self) -> RankReport:
        """Called by rank 0 in each of its health checks; raises when this rank cannot
        serve (its step thread ended)."""
        if not self.thread.is_alive():
            raise RuntimeError(
                f"{self.spec.worker_id} rank {self.rank}: step loop ended ({self.failure!r})"
            )
        return RankReport(
            self.rank, os.getpid(), self.engine.steps, *weight_and_kv_bytes(self.engine)
        )

    # --- KV, as rank 0 asks (worker/kv_shards.py) --------------------------------------

    async def export(
        self, request_id: str, block_ids: list[int], num_tokens: int, peer_id: str
    ) -> ExportTicket:
        """Pin this rank's copy of the blocks rank 0 exports (rank 0's step that wrote
        them is over on every rank: its logits gather waited for this one)."""
        self._drain_released()
        return await asyncio.to_thread(
            self.sender.export, request_id, block_ids, num_tokens, peer_id
        )

    async def ack(self, request_id: str) -> None:
        self.sender.ack(request_id)
        self._drain_released()

    async def abort(self, request_id: str) -> None:
        self.sender.abort(request_id)
        self._drain_released()

    async def leases(self) -> list[str]:
        """Exports this rank still pins (every rank's must end empty)."""
        return self.sender.leased_request_ids() if self.sender is not None else []

    def _drain_released(self) -> None:
        """Released exports' block ids: rank 0's allocator frees the blocks for every
        rank, so a follower only empties its registry's queue."""
        if self.sender is not None:
            self.sender.poll_released()

    async def fetch(
        self, ticket: ExportTicket, dst_block_ids: list[int], timeout_s: float, held_blocks: int
    ) -> TransferResult:
        """Pull this rank's heads of the export into the blocks rank 0 reserved."""
        return await asyncio.to_thread(
            self.receiver.fetch, ticket, dst_block_ids, timeout_s, held_blocks
        )

    async def cancel(self, request_id: str) -> None:
        if self.receiver is not None:
            self.receiver.cancel(request_id)

    async def wait_until_stopped(self) -> None:
        """Rank 0's death watch: returns only at shutdown."""
        self.stopped = self.stopped or asyncio.Event()
        await self.stopped.wait()

    async def shutdown(self) -> None:
        if self.stopped is not None:
            self.stopped.set()
        for transport in (self.sender, self.receiver):
            if transport is not None:
                transport.close()
        self.thread.join(timeout=5)


def weight_and_kv_bytes(engine) -> tuple[int, int]:
    """(weights, KV pool) bytes of an engine or a follower engine on this rank."""
    pool = engine.kv_pool.kv
    return engine.model.weights.nbytes_streamed(), pool.numel() * pool.element_size()
