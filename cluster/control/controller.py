"""Starts Ray (or joins it), places the worker pools, and watches them.

Placement: each node advertises a custom resource per pool (`prefill_pool`,
`decode_pool`); a prefill actor asks for one unit of `prefill_pool` (plus GPUs on
GPU pools), so it can only land on a node of that pool. The embedded local cluster
advertises both pools. Workers are named actors in the `pdserve` namespace.

Watching, three ways, whichever notices first:
  * a death watch: one call per worker that only returns when the actor stops, so
    Ray's notice that its process died arrives within milliseconds;
  * every `health_interval_s` a `check_health` call, waiting at most
    `health_timeout_s` (a hung worker);
  * the request flow, when a call to a worker fails.
Each names the actor generation it saw fail; a failure of an older generation than
the worker's current one is stale and ignored. A dead worker stops being routed to
at once; a standby spare of its role (`standby_workers`) takes its place at once, and
the dead one is killed for good and started again: the first attempt at once, or
after `standby_restart_delay_s` when a spare took its place, then with exponential
backoff, up to `max_restarts` times in a crash loop (a generation that stayed healthy
for `restart_budget_reset_s` was not in one and gives the budget back). A restart
takes a prestarted process of the role when one waits (`prestarted_workers`,
cluster/control/prestarted.py) and only builds the engine in it; otherwise it starts a new
process. A restarted worker is routed to again when its first health call succeeds,
or becomes the role's spare if the role is at strength.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import POOL_RESOURCES, ClusterConfig, PoolName, pool_of
from cluster.control.core_plan import CorePlan, plan_cores
from cluster.control.local_head import local_head_pids, start_local_head
from cluster.control.prestarted import PrestartedProcesses
from cluster.control.ray_access import warn_if_joined_without_token
from cluster.control.worker_info import WorkerInfo
from decode_worker.worker import DecodeWorker
from engine import envs
from engine.cpu_affinity import BOOT_CORES_ENV, pin_process, process_cores
from prefill_worker.worker import PrefillWorker
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

PRESTARTED_POOL_SHARE = 0.01


class Controller:
    """Owned by the cluster object in the driver (the HTTP frontend's process)."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.workers: dict[str, WorkerInfo] = {}
        self.started_ray = False
        self.core_plan: CorePlan | None = None
        """Each worker's cores, when this controller started Ray and pinning applies."""
        self.driver_cores: tuple[int, ...] = ()
        """This process's cores before the plan moved it (given back at shutdown)."""
        self.watch_task: asyncio.Task | None = None
        self.restart_tasks: dict[str, asyncio.Task] = {}
        self.death_watches: dict[str, asyncio.Task] = {}
        self.prestarted = PrestartedProcesses(config.prestarted_workers, self._start_prestarted)

    # --- start / stop ---------------------------------------------------------------

    def init_ray(self) -> None:
        if ray.is_initialized():
            return
        if self.config.address:
            ray.init(
                address=self.config.address, namespace=self.config.namespace, log_to_driver=False
            )
            warn_if_joined_without_token(self.config.address)
        else:
            self.driver_cores = process_cores()
            self.core_plan = plan_cores(self.config, self.driver_cores)
            start_local_head(self.config.namespace)
            self.started_ray = True

    def worker_pids(self) -> set[int]:
        """The processes of the workers that have reported health: what the core plan
        and the CPU metrics tell apart from Ray's own processes."""
        return {w.load.pid for w in self.workers.values() if w.load is not None}

    def _confine_the_rest(self) -> None:
        """Once every planned worker is up on its own cores: this process and the local
        head's other processes onto the cores left to them (cluster/control/core_plan.py); the
        processes the raylet starts later inherit them, unless a worker's cores are in
        their environment. Not before: with Ray's start on one core of two, a 1 + 1 demo
        cluster answered first after 21.1 s, against 14.1 s on both."""
        if self.core_plan is None:
            return
        workers = self.worker_pids()
        pin_process(self.core_plan.others)
        for pid in local_head_pids():
            if pid not in workers:
                pin_process(self.core_plan.others, pid)
        logger.info(
            "cores: %s; driver and Ray on %s", self.core_plan.workers, self.core_plan.others
        )

    def _worker_spec(self, worker: WorkerInfo):
        cores = self.core_plan.cores_of(worker.worker_id) if self.core_plan else None
        return self.config.worker_spec(worker.worker_id, worker.role, cores)

    async def start(self) -> None:
        self.init_ray()
        for worker_id, role, standby in self.config.planned_workers():
            worker = WorkerInfo(worker_id, role, handle=None, standby=standby)
            worker.handle = self._spawn(worker)
            self.workers[worker_id] = worker
        await asyncio.gather(*(self._first_health(w) for w in self.workers.values()))
        self._confine_the_rest()
        self.watch_task = asyncio.get_running_loop().create_task(self._watch())
        for role in {w.role for w in self.workers.values()}:  # after the workers: off their start
            self.prestarted.fill(role)

    def _target(self, role: str) -> int:
        """Workers of `role` that take requests at full strength."""
        return self.config.pool(pool_of(role)).workers

    def _spawn(self, worker: WorkerInfo):
        """Start the next generation of `worker`'s actor in a new process; returns its handle.
        A tensor-parallel worker gets a placement group of its own first (one bundle per
        rank, packed on one node), whose bundle 0 takes this actor, rank 0; rank 0 starts
        the other ranks in the other bundles."""
        worker.generation += 1
        # A restarted worker gets a fresh name: the dead actor's name is released lazily.
        name = f"pdserve-{worker.worker_id}-g{worker.generation - 1}"
        spec = self._worker_spec(worker)
        if spec.tp_size == 1:
            return self._start_actor(worker.role, name, 1.0, spec)
        worker.placement_group = rank_placement_group(spec, name)
        return self._start_actor(worker.role, name, 1.0, spec, group=worker.placement_group)

    def _start_prestarted(self, role: str, name: str):
        """A process for `PrestartedProcesses`: imports done, nothing built. It asks for a
        sliver of its pool's resource, which keeps it on that pool's nodes without taking
        a worker's slot (a node may advertise exactly one unit per worker)."""
        return self._start_actor(
            role, name, PRESTARTED_POOL_SHARE, None, self.config.transport.name
        )

    def _start_actor(
        self,
        role: str,
        name: str,
        pool_units: float,
        spec: WorkerSpec | None,
        transport: str | None = None,
        group=None,
    ):
        """A worker actor of `role` in a new process, built for `spec`, or prestarted
        (`spec` None) with `transport`'s module imported; in bundle 0 of `group` (a
        tensor-parallel worker's rank 0) where one is given."""
        threads = str(self.config.worker_threads)
        # Keep BLAS/OpenMP pools at the configured size: workers share the cores.
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **envs.worker_run_settings()}
        if spec is not None and spec.cpu_cores is not None:
            env[BOOT_CORES_ENV] = ",".join(map(str, spec.cpu_cores))
        options = dict(
            name=name,
            namespace=self.config.namespace,
            resources={POOL_RESOURCES[role]: pool_units},
            num_cpus=0,
            num_gpus=self.config.gpus_per_worker,
            max_concurrency=1000,
            runtime_env={"env_vars": env},
        )
        if group is not None:
            options.update(
                resources=dict(spec.rank_resources),
                num_gpus=spec.rank_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0
                ),
            )
        actor = PrefillWorker if role == "prefill" else DecodeWorker
        return ray.remote(actor).options(**options).remote(spec, transport)

    async def _activate(self, worker: WorkerInfo, handle) -> None:
        """Make the prestarted process `handle` `worker`'s next generation, and start its
        replacement later, off the recovery's cores."""
        worker.generation += 1
        worker.handle = handle
        self.prestarted.refill_later(worker.role, self.config.standby_restart_delay_s)
        await handle.activate.remote(self._worker_spec(worker))

    async def _first_health(self, worker: WorkerInfo, restarted: bool = False) -> None:
        worker.load = await worker.handle.check_health.remote()
        if restarted:  # a spare, unless its role is short of workers right now
            worker.standby = self._at_strength(worker.role)
        worker.alive, worker.dead_since = True, None
        worker.alive_since = time.monotonic()
        self._watch_death(worker)
        logger.info("worker %s ready (pid %s)", worker.worker_id, worker.load.pid)

    async def shutdown(self) -> None:
        if self.watch_task is not None:
            self.watch_task.cancel()
        self.prestarted.shutdown()
        for task in [*self.restart_tasks.values(), *self.death_watches.values()]:
            task.cancel()
        for worker in self.workers.values():
            # A dead or stuck worker is killed below either way.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(worker.handle.shutdown.remote(), timeout=5)
            ray.kill(worker.handle, no_restart=True)
            _release_group(worker)
        self.workers.clear()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        if self.core_plan is not None:
            pin_process(self.driver_cores)
            self.core_plan = None

    # --- watching ---------------------------------------------------------------------

    def _watch_death(self, worker: WorkerInfo) -> None:
        generation, handle = worker.generation, worker.handle

        async def watch() -> None:
            try:
                await handle.wait_until_stopped.remote()
            except Exception as exc:  # the actor is gone (or unreachable)
                self.mark_dead(worker, f"death watch: {exc!r}", generation)

        previous = self.death_watches.pop(worker.worker_id, None)
        if previous is not None:
            previous.cancel()
        self.death_watches[worker.worker_id] = asyncio.get_running_loop().create_task(watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self.probe(w) for w in list(self.workers.values()) if w.alive))
            for role in {w.role for w in self.workers.values()}:
                if not self._at_strength(role):
                    self._promote_spare(role)

    async def probe(self, worker: WorkerInfo) -> bool:
        """One health call; marks the worker dead on error or timeout."""
        generation = worker.generation
        try:
            worker.load = await asyncio.wait_for(
                worker.handle.check_health.remote(), timeout=self.config.health_timeout_s
            )
        except Exception as exc:  # any failed health call means unhealthy
            self.mark_dead(worker, repr(exc), generation)
            return False
        self._restore_budget_if_healthy(worker)
        return True

    def _restore_budget_if_healthy(self, worker: WorkerInfo) -> None:
        """The restart budget guards against crash loops: a generation that stayed
        healthy for `restart_budget_reset_s` was not one, so its death (a kill, a rare
        fault) starts the count over; checked on every health call and at death."""
        healthy_for = time.monotonic() - worker.alive_since
        if worker.recent_restarts and healthy_for >= self.config.restart_budget_reset_s:
            logger.info(
                "worker %s healthy for %.0f s: restart budget restored",
                worker.worker_id,
                healthy_for,
            )
            worker.recent_restarts = 0

    def mark_dead(self, worker: WorkerInfo, why: str, generation: int | None = None) -> None:
        """Stop routing to `worker` at once, put a spare in its place, schedule its restart.
        `generation` is the actor incarnation the failure was seen on; an older one than
        the worker's current generation is a stale report and changes nothing."""
        if generation is not None and generation != worker.generation:
            logger.info("stale failure of %s generation %d ignored", worker.worker_id, generation)
            return
        if worker.alive:
            logger.warning("worker %s marked dead: %s", worker.worker_id, why)
            self._restore_budget_if_healthy(worker)
            worker.dead_since = time.monotonic()
            if not worker.standby:
                self._promote_spare(worker.role)
        worker.alive = False
        worker.standby = False
        pending = self.restart_tasks.get(worker.worker_id)
        if (pending is None or pending.done()) and worker.worker_id in self.workers:
            # With a spare in its place the restart only rebuilds the spare, and its
            # imports take a core for seconds: on a small node, from the recovery.
            delay = self.config.standby_restart_delay_s if self._at_strength(worker.role) else 0
            task = asyncio.get_running_loop().create_task(self._restart(worker, delay))
            self.restart_tasks[worker.worker_id] = task

    def _promote_spare(self, role: str) -> None:
        spare = next(
            (w for w in self.workers.values() if w.role == role and w.alive and w.standby), None
        )
        if spare is not None:
            spare.standby = False
            logger.info("standby %s takes over for a dead %s worker", spare.worker_id, role)

    async def _restart(self, worker: WorkerInfo, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        backoff = 0.0
        while worker.recent_restarts < self.config.max_restarts:
            await asyncio.sleep(backoff)
            backoff = backoff * 2 if backoff else self.config.restart_backoff_s
            with contextlib.suppress(Exception):
                ray.kill(worker.handle, no_restart=True)
            _release_group(worker)  # and with it the dead worker's other ranks
            worker.restarts += 1
            worker.recent_restarts += 1
            try:
                await asyncio.wait_for(
                    self._next_generation(worker), timeout=self.config.recovery_timeout_s * 4
                )
            except Exception as exc:
                logger.warning(
                    "restart %d of %s failed: %r", worker.recent_restarts, worker.worker_id, exc
                )
                continue
            logger.info(
                "worker %s restarted%s (%d/%d)",
                worker.worker_id,
                " as a standby" if worker.standby else "",
                worker.recent_restarts,
                self.config.max_restarts,
            )
            return
        logger.error(
            "worker %s stays dead: %d restarts used", worker.worker_id, worker.recent_restarts
        )

    async def _next_generation(self, worker: WorkerInfo) -> None:
        """Start `worker` again, in a prestarted process when one waits, and wait for its
        first health call."""
        prestarted = self.prestarted.take(worker.role)
        if prestarted is not None:
            await self._activate(worker, prestarted)
        else:
            worker.handle = self._spawn(worker)
        await self._first_health(worker, restarted=True)

    def kv_capacity(self, pool: PoolName) -> int | None:
        """The KV blocks each worker of `pool` can hand out (colocated workers are the
        `decode` pool): the fewest any of them reported in its last health report, None
        before one has. The cluster checks and prints a pool its workers sized from the
        device by it after `start`, and admits requests by it."""
        reported = [
            w.load.total_blocks
            for w in self.workers.values()
            if w.load is not None and pool_of(w.role) == pool
        ]
        return min(reported, default=None)

    def _at_strength(self, role: str) -> bool:
        routed = [w for w in self.workers.values() if w.role == role and w.alive and not w.standby]
        return len(routed) >= self._target(role)

    async def step_traces(self, last: int) -> dict[str, list[dict]]:
        """Each live worker's last `last` engine steps (`/admin/steps`)."""
        live = [w for w in self.workers.values() if w.alive]
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(w.handle.steps.remote(last), self.config.health_timeout_s)
                for w in live
            ),
            return_exceptions=True,
        )
        return {w.worker_id: r for w, r in zip(live, replies, strict=True) if isinstance(r, list)}

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


def rank_placement_group(spec: WorkerSpec, name: str):
    """The placement group of one generation of a tensor-parallel worker: a bundle per
    rank (its share of the pool's resource, and its GPU on GPU pools), STRICT_PACK, so
    the ranks share a node (their group's store is on loopback)."""
    bundle = dict(spec.rank_resources)
    if spec.rank_gpus:
        bundle["GPU"] = spec.rank_gpus
    return placement_group([dict(bundle) for _ in range(spec.tp_size)], "STRICT_PACK", name=name)


def _release_group(worker: WorkerInfo) -> None:
    """Remove a dead or stopped generation's placement group (Ray kills what still runs
    in it: the followers of a rank 0 that is gone)."""
    group, worker.placement_group = worker.placement_group, None
    if group is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
