"""A follower rank of a tensor-parallel worker: a small Ray actor of its own process.

Lifecycle: started by its worker's rank 0 (`TPRanks`) in bundle `rank` of the worker's
placement group -> its constructor joins the worker's TP group on rank 0's store and
builds its shard of the model and its KV pool (`FollowerEngine`), then runs rank 0's
steps on a thread of its own until rank 0 sends STOP or a peer dies. Rank 0 checks it
in every health check (`check_health`) and watches its death (`wait_until_stopped`):
a follower's death is the worker's death. Its process dies with rank 0 (Ray kills the
actors an actor owns when it dies) and with its placement group.

KV: each follower has its own transport, over its own pool, and rank 0 asks it
(`KVShard` calls) to export, release, fetch or cancel the same blocks it does.
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
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name=f"tp-rank-{rank}", daemon=True)
        self.thread.start()
        self.stopped: asyncio.Event | None = None
        self.shard = None
        """This rank's KV transport (`worker.kv_shard.KVShard`), once rank 0 made it."""

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

    async def wait_until_stopped(self) -> None:
        """Rank 0's death watch: returns only at shutdown."""
        self.stopped = self.stopped or asyncio.Event()
        await self.stopped.wait()

    async def shutdown(self) -> None:
        if self.stopped is not None:
            self.stopped.set()
        if self.shard is not None:
            self.shard.close()
        self.thread.join(timeout=5)


def weight_and_kv_bytes(engine) -> tuple[int, int]:
    """(weights, KV pool) bytes of an engine or a follower engine on this rank."""
    pool = engine.kv_pool.kv
    return engine.model.weights.nbytes_streamed(), pool.numel() * pool.element_size()
