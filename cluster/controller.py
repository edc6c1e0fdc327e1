"""Starts Ray (or joins it), places the worker pools, and watches them.

Placement: each node advertises a custom resource per pool (`prefill_pool`,
`decode_pool`); a prefill actor asks for one unit of `prefill_pool` (plus GPUs on
GPU pools), so it can only land on a node of that pool. The embedded local cluster
advertises both pools. Workers are named actors in the `pdserve` namespace.

Watching: every `health_interval_s` the controller calls `check_health` on every
worker and waits at most `health_timeout_s`; an error or a timeout marks the worker
dead at once, so the router stops picking it. The request flow marks a worker dead
too when a call to it fails. A dead worker is killed for good and started again
(up to `max_restarts` times, with exponential backoff); the router takes it back
when the new actor's first health call succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import ray

from cluster.config import ClusterConfig
from cluster.router import WorkerInfo
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker

logger = logging.getLogger(__name__)

POOL_RESOURCES = {"prefill": "prefill_pool", "decode": "decode_pool", "colocated": "decode_pool"}
_LOCAL_POOL_CAPACITY = 64


class Controller:
    """Owned by the cluster object in the driver (the HTTP frontend's process)."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.workers: dict[str, WorkerInfo] = {}
        self.started_ray = False
        self.watch_task: asyncio.Task | None = None
        self.restart_tasks: dict[str, asyncio.Task] = {}
        self.generations: dict[str, int] = {}

    # --- start / stop ---------------------------------------------------------------

    def init_ray(self) -> None:
        if ray.is_initialized():
            return
        if self.config.address:
            ray.init(
                address=self.config.address, namespace=self.config.namespace, log_to_driver=False
            )
        else:
            ray.init(
                namespace=self.config.namespace,
                num_cpus=os.cpu_count(),
                resources={
                    "prefill_pool": _LOCAL_POOL_CAPACITY,
                    "decode_pool": _LOCAL_POOL_CAPACITY,
                },
                include_dashboard=False,
                log_to_driver=False,
            )
            self.started_ray = True

    async def start(self) -> None:
        self.init_ray()
        for role, index in self._planned_workers():
            worker_id = f"{role}-{index}"
            self.workers[worker_id] = WorkerInfo(worker_id, role, self._spawn(worker_id, role))
        await asyncio.gather(*(self._first_health(w) for w in self.workers.values()))
        self.watch_task = asyncio.get_running_loop().create_task(self._watch())

    def _planned_workers(self) -> list[tuple[str, int]]:
        """(role, index within role) of every worker to start."""
        if self.config.mode == "colocated":
            return [("colocated", i) for i in range(self.config.decode_workers)]
        return [("prefill", i) for i in range(self.config.prefill_workers)] + [
            ("decode", i) for i in range(self.config.decode_workers)
        ]

    def _spawn(self, worker_id: str, role: str):
        threads = str(self.config.threads_per_worker)
        # A restarted worker gets a fresh name: the dead actor's name is released lazily.
        generation = self.generations.get(worker_id, 0)
        self.generations[worker_id] = generation + 1
        options = dict(
            name=f"pdserve-{worker_id}-g{generation}",
            namespace=self.config.namespace,
            resources={POOL_RESOURCES[role]: 1},
            num_cpus=0,
            num_gpus=self.config.gpus_per_worker,
            max_concurrency=1000,
            # Keep BLAS/OpenMP pools at the configured size: workers share the cores.
            runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}},
        )
        spec = self.config.worker_spec(worker_id, role)
        actor = PrefillWorker if role == "prefill" else DecodeWorker
        return ray.remote(actor).options(**options).remote(spec)

    async def _first_health(self, worker: WorkerInfo) -> None:
        worker.load = await worker.handle.check_health.remote()
        logger.info("worker %s ready (pid %s)", worker.worker_id, worker.load.pid)

    async def shutdown(self) -> None:
        if self.watch_task is not None:
            self.watch_task.cancel()
        for task in self.restart_tasks.values():
            task.cancel()
        for worker in self.workers.values():
            # A dead or stuck worker is killed below either way.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(worker.handle.shutdown.remote(), timeout=5)
            ray.kill(worker.handle, no_restart=True)
        self.workers.clear()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    # --- watching ---------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self.probe(w) for w in list(self.workers.values()) if w.alive))

    async def probe(self, worker: WorkerInfo) -> bool:
        """One health call; marks the worker dead on error or timeout."""
        try:
            worker.load = await asyncio.wait_for(
                worker.handle.check_health.remote(), timeout=self.config.health_timeout_s
            )
            return True
        except Exception as exc:  # any failed health call means unhealthy
            self.mark_dead(worker, repr(exc))
            return False

    def mark_dead(self, worker: WorkerInfo, why: str) -> None:
        """Stop routing to `worker` at once and schedule its restart."""
        if worker.alive:
            logger.warning("worker %s marked dead: %s", worker.worker_id, why)
        worker.alive = False
        pending = self.restart_tasks.get(worker.worker_id)
        if (pending is None or pending.done()) and worker.worker_id in self.workers:
            task = asyncio.get_running_loop().create_task(self._restart(worker))
            self.restart_tasks[worker.worker_id] = task

    async def _restart(self, worker: WorkerInfo) -> None:
        backoff = self.config.restart_backoff_s
        while worker.restarts < self.config.max_restarts:
            await asyncio.sleep(backoff)
            backoff *= 2
            with contextlib.suppress(Exception):
                ray.kill(worker.handle, no_restart=True)
            worker.restarts += 1
            worker.handle = self._spawn(worker.worker_id, worker.role)
            try:
                await asyncio.wait_for(
                    self._first_health(worker), timeout=self.config.recovery_timeout_s * 4
                )
            except Exception as exc:
                logger.warning(
                    "restart %d of %s failed: %r", worker.restarts, worker.worker_id, exc
                )
                continue
            worker.alive = True
            logger.info(
                "worker %s restarted (%d/%d)",
                worker.worker_id,
                worker.restarts,
                self.config.max_restarts,
            )
            return
        logger.error("worker %s stays dead: %d restarts used", worker.worker_id, worker.restarts)

    async def debug_states(self) -> dict[str, dict]:
        """Leak check across the cluster: per live worker, blocks used and leases held."""
        live = [w for w in self.workers.values() if w.alive]
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(w.handle.debug_state.remote(), self.config.health_timeout_s)
                for w in live
            ),
            return_exceptions=True,
        )
        # A worker that dies while answering is left out; its restart starts empty.
        return {w.worker_id: r for w, r in zip(live, replies, strict=True) if isinstance(r, dict)}
