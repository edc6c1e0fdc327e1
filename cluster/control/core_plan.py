"""Which cores each worker of a local CPU cluster runs on, and where the rest runs.

With nothing pinned, the frontend, the Ray driver and Ray's own processes run on
whichever core is free, and on a small node that is often a prefill worker's: at 16
streams on 2 cores (1 + 1 workers, 256-token prompts) the prefill worker had 91% of a
core and set the pace, while the decode worker, whose steps have time to spare, had all
of its own. So each worker gets its own cores, prefill workers first, and the rest of
the cluster the cores no worker has, or failing those the decode workers'. That served
6-8% more at 16 streams; at one stream, where the prefill core idles between prompts,
the decode worker's core is shared and its TPOT rose from ~28.5 to ~32 ms. Pinning the
workers alone, the rest left on every core, lost at 16 streams and at one.

The controller makes the plan when it starts Ray itself (`Controller.init_ray`) and
puts each worker's cores in its `WorkerSpec` and its process's environment; the
worker's process pins itself as it boots, before its imports
(`engine.cpu_affinity.pin_at_boot`), and again before it builds its engine. Ray starts
on every core; once every worker is up, the controller moves its own process and Ray's
onto `others`. So a restarted worker boots on the dead one's cores, not on a
survivor's. No plan where it cannot hold: GPU pools, a Ray cluster joined by address,
colocated workers (one worker has every core), warm spares (a spare that takes over
would need the dead worker's cores), tensor-parallel pools (a worker is several
processes), or more worker threads than cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.config import ClusterConfig


@dataclass(frozen=True)
class CorePlan:
    workers: dict[str, tuple[int, ...]]
    """Worker id -> its cores (`worker_threads` of them)."""
    others: tuple[int, ...]
    """The driver's: the frontend, the router, the controller and Ray's own processes."""

    def cores_of(self, worker_id: str) -> tuple[int, ...] | None:
        return self.workers.get(worker_id)


def plan_cores(config: ClusterConfig, cores: Sequence[int]) -> CorePlan | None:
    """The plan for `config` on `cores` (the driver's own, sorted), or None (see above)."""
    if not config.pin_cores or config.gpus_per_worker > 0 or config.address is not None:
        return None
    if config.mode != "disaggregated" or config.standby_workers > 0:
        return None
    if any(config.pool(role).tp > 1 for role in config.roles_in_use):
        return None  # a worker's ranks are processes of their own, placed by Ray
    threads = config.worker_threads
    planned = config.planned_workers()  # no spares here: every one serves
    if len(planned) * threads > len(cores):
        return None
    workers = {
        wid: tuple(cores[i * threads : (i + 1) * threads]) for i, (wid, _, _) in enumerate(planned)
    }
    spare = tuple(cores[len(planned) * threads :])
    decode = tuple(c for wid, role, _ in planned if role == "decode" for c in workers[wid])
    return CorePlan(workers, spare or decode)
