"""What every worker reports about itself; shared by the prefill and decode actors.

`health_report` is built inside a worker's `check_health` (called by the controller's
watchdog); the router reads its load fields and the metrics layer the rest.
"""

from __future__ import annotations

import os

from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine


def health_report(
    worker_id: str,
    role: str,
    engine: LLMEngine,
    loop: EngineLoop,
    device: str,
    admission_waiting: int = 0,
) -> dict:
    """Raises when the worker cannot serve (its engine thread died)."""
    import torch

    from cluster.gpu_stats import read_gpu_stats

    if not loop.thread.is_alive():
        raise RuntimeError(f"{role} worker {worker_id}: engine thread died")
    stats = engine.stats()
    waiting = stats.num_waiting + admission_waiting
    return {
        "worker_id": worker_id,
        "role": role,
        "queue_depth": waiting + stats.num_running,
        "free_blocks": stats.free_blocks,
        "total_blocks": stats.total_blocks,
        "num_running": stats.num_running,
        "num_waiting": waiting,
        "batch_sizes": {"prefill": stats.prefill_batch_sizes, "decode": stats.decode_batch_sizes},
        "num_threads": torch.get_num_threads(),
        "gpu": read_gpu_stats(device),
        "node_id": node_id(),
        "pid": os.getpid(),
    }


def node_ip() -> str | None:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else None


def node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
