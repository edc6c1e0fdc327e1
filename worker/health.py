"""The health report every worker builds in `check_health`; shared by both worker kinds.

The controller's watchdog calls `check_health` every `health_interval_s`; the router
reads the load fields of the `HealthReport` and the metrics layer the rest.
"""

from __future__ import annotations

import dataclasses
import os
import time

from engine.cpu_affinity import process_cores
from engine.engine_loop import EngineLoop
from engine.gpu_stats import read_gpu_stats
from engine.llm_engine import LLMEngine
from engine.step_costs import fit_step_costs
from worker.messages import HealthReport


def health_report(
    worker_id: str,
    role: str,
    engine: LLMEngine,
    loop: EngineLoop,
    transfer=None,
    last_transfer: dict[str, str] | None = None,
    startup: dict[str, float] | None = None,
    rank_pids: tuple[int, ...] = (),
) -> HealthReport:
    """Raises when the worker cannot serve (its engine thread died)."""
    if not loop.thread.is_alive():
        raise RuntimeError(f"{role} worker {worker_id}: engine thread died")
    stats = engine.stats()
    return HealthReport(
        worker_id=worker_id,
        role=role,
        queue_depth=stats.num_waiting + stats.num_running,
        free_blocks=stats.free_blocks,
        total_blocks=stats.total_blocks,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_threads=engine.num_threads,
        pid=os.getpid(),
        node_id=node_id(),
        cpu_cores=process_cores(),
        batch_sizes={"prefill": stats.prefill_batch_sizes, "decode": stats.decode_batch_sizes},
        gpu=read_gpu_stats(engine.config.device),
        transfer=transfer,
        last_transfer=dict(last_transfer or {}),
        startup=dict(startup or {}),
        prefix_cache=engine.cache_report(),
        step_costs=fit_step_costs(engine.step_trace),
        cpu_s=time.process_time(),
        rank_pids=rank_pids,
        tp_size=engine.tp.size,
    )


def engine_state(engine: LLMEngine) -> dict:
    """A worker's `debug_state` (leak checks in tests and drills, `/admin/workers`); run
    on the engine thread, which owns what it reads."""
    return {
        "used_blocks": engine.allocator.num_used,
        "sequences": len(engine.sequences),
        "requests": engine.request_states(),
        "tokens_left": engine.tokens_left(),
        "kv_pool_private_resident_bytes": engine.kv_pool.private_resident_bytes(),
    }


class StartupTimer:
    """Times a worker's build, step by step: from its process's start (`process_s`), or,
    on a prestarted process that a restart took, from its activation, noting how long
    the process had waited ready (`prestarted_s`)."""

    def __init__(self, prestarted: bool = False) -> None:
        import psutil

        age = time.time() - psutil.Process().create_time()
        self.durations = {"prestarted_s" if prestarted else "process_s": age}
        self._last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.durations[name] = now - self._last
        self._last = now


def step_trace(engine: LLMEngine, last: int) -> list[dict]:
    """A worker's `steps(last)`: its engine's last steps, oldest first (engine thread)."""
    records = list(engine.step_trace)[-last:] if last > 0 else []
    return [dataclasses.asdict(r) for r in records]


def node_ip() -> str | None:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else None


def node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
