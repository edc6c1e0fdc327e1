"""The controller's record of one worker, which the data plane reads and updates.

The controller creates one `WorkerInfo` per worker and owns its liveness, handle and
restart counts; the router picks among the live ones by `score`, and the claims of
requests placed there count their load on it (cluster/flow/router.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.messages import HealthReport


@dataclass
class WorkerInfo:
    """The controller's record of one worker; the router reads it."""

    worker_id: str
    role: str
    handle: Any
    alive: bool = True
    load: HealthReport | None = None
    """The worker's last health report (None before its first one)."""
    in_flight: int = 0
    """Requests holding a claim on this worker."""
    claimed_tokens: int = 0
    """Tokens of work those claims bring: prompt tokens still to compute on a prefill
    worker, prompt tokens resident on a decode worker."""
    local_prefill_tokens: int = 0
    """Decode workers: prompt tokens it was asked to prefill itself (`disaggregation:
    auto` chose local) and has not answered yet; `LocalPrefill` holds them."""
    restarts: int = 0
    """Restarts over the cluster's life (a counter for metrics)."""
    generation: int = 0
    """Which actor incarnation `handle` is; failures seen on an older one are stale."""
    standby: bool = False
    """A warm spare: alive and ready, but not routed to until it takes a dead worker's place."""
    recent_restarts: int = 0
    """Restarts counted against `max_restarts`; reset after a healthy period."""
    alive_since: float = 0.0
    dead_since: float | None = None
    """Monotonic time it was marked dead (None while alive)."""
    placement_group: Any = None
    """A tensor-parallel worker's current placement group (None: one rank, none)."""

    def score(self) -> tuple[float, float]:
        """Lower is better: outstanding work first, then fewer free KV blocks."""
        if self.load is None:
            return (self.in_flight, 0.0)
        free = self.load.free_blocks / max(1, self.load.total_blocks)
        return (self.load.queue_depth + self.in_flight, -free)
