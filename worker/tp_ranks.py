"""Rank 0's side of a tensor-parallel worker: its followers, their group, their health.

Lifecycle (inside rank 0's actor, the one the controller and the router talk to):
`TPRanks.start(spec)` at the worker's build, before its engine: a store on loopback
(every rank of a worker is on one node: the controller placed the worker's placement
group STRICT_PACK), one `RankFollower` actor per rank 1..N-1 in bundle `rank` of the
group rank 0 runs in, then rank 0 joins the TP group with them (`group`), which
returns once every follower has joined; rank 0's `LLMEngine` is built over it while
the followers build their shards. Then:
  * `check()` from rank 0's `check_health`: every follower answers its health call
    within the timeout, or the worker is unhealthy (the controller restarts it);
  * `watch()` from rank 0's first health check: a follower whose process dies takes
    the worker down at once (rank 0 exits; the controller's death watch sees that
    within milliseconds and restarts the whole group, whose requests recover as any
    dead worker's do);
  * `stop(engine)` at shutdown, after rank 0's engine thread stopped: STOP to every
    follower, then their own shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets

import ray
import torch.distributed as dist

from engine.llm_engine import LLMEngine
from engine.parallel.group import TPGroup
from kv_transfer.transports.collective import listening_store
from worker.rank_follower import GroupAddress, RankFollower, RankReport
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
STORE_TIMEOUT_S = 120.0
DEATH_EXIT_CODE = 70
"""Rank 0's exit status when a follower died (the controller restarts the worker)."""


class TPRanks:
    """Owned by rank 0's actor of a worker whose `spec.tp_size` > 1."""

    def __init__(self, spec: WorkerSpec, followers: list, group: TPGroup, store):
        self.spec = spec
        self.followers = followers
        """Actor handles of ranks 1..N-1, in rank order."""
        self.group = group
        self._store = store  # kept alive: the followers' clients talk to it
        self._watches: list[asyncio.Task] = []
        self.reports: list[RankReport] = []
        """The followers' last health answers."""

    @classmethod
    def start(cls, spec: WorkerSpec) -> TPRanks:
        store = listening_store(LOOPBACK, STORE_TIMEOUT_S)
        address = GroupAddress(LOOPBACK, store.port, f"tp-{secrets.token_hex(8)}")
        followers = [_start_follower(spec, rank, address) for rank in range(1, spec.tp_size)]
        group = TPGroup.join(dist.PrefixStore(address.prefix, store), 0, spec.tp_size, spec.device)
        logger.info("%s: %d tensor-parallel ranks joined", spec.worker_id, spec.tp_size)
        return cls(spec, followers, group, store)

    async def check(self, timeout_s: float) -> list[RankReport]:
        """Every follower's health, raising (so rank 0's check fails) when one does not
        answer in `timeout_s` or says it cannot serve."""
        calls = [f.check_health.remote() for f in self.followers]
        try:
            self.reports = list(await asyncio.wait_for(asyncio.gather(*calls), timeout_s))
        except Exception as exc:
            raise RuntimeError(
                f"{self.spec.worker_id}: a tensor-parallel rank failed: {exc!r}"
            ) from exc
        return self.reports

    def watch(self) -> None:
        """Start the followers' death watches (once, from rank 0's event loop)."""
        if self._watches:
            return
        loop = asyncio.get_running_loop()
        self._watches = [
            loop.create_task(self._watch(rank, f)) for rank, f in enumerate(self.followers, 1)
        ]

    async def _watch(self, rank: int, follower) -> None:
        try:
            await follower.wait_until_stopped.remote()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error(
                "%s: tensor-parallel rank %d died (%r); the worker goes down with it",
                self.spec.worker_id,
                rank,
                exc,
            )
            self.group.abort()
            os._exit(DEATH_EXIT_CODE)

    @property
    def pids(self) -> tuple[int, ...]:
        """Ranks 1..N-1's processes, as their last health answers gave them."""
        return tuple(report.pid for report in self.reports)

    def stop(self, engine: LLMEngine | None, engine_stopped: bool) -> None:
        """At shutdown: STOP to the followers (only once rank 0's engine thread, which
        owns the channel, has stopped), then their own shutdown."""
        for watch in self._watches:
            watch.cancel()
        if engine is not None and engine_stopped:
            try:
                engine.stop_followers()
            except Exception as exc:  # a follower already gone: nothing to stop
                logger.info("%s: STOP not delivered: %r", self.spec.worker_id, exc)
        for follower in self.followers:
            follower.shutdown.remote()


def _start_follower(spec: WorkerSpec, rank: int, address: GroupAddress):
    """Rank `rank`'s actor, in bundle `rank` of the placement group rank 0 runs in (none
    in a test that starts a worker outside one: the node is then the only node)."""
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    threads = str(spec.engine.num_threads or 1)
    options = dict(
        name=f"{ray.get_runtime_context().get_actor_name() or spec.worker_id}-rank{rank}",
        num_cpus=0,
        num_gpus=spec.rank_gpus,
        resources=dict(spec.rank_resources),
        max_concurrency=64,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}},
    )
    group = get_current_placement_group()
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=rank
        )
    return ray.remote(RankFollower).options(**options).remote(spec, rank, address)
