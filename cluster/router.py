"""Picks a (prefill, decode) pair per request from the live membership.

Policies see each worker's last health report (queue depth, free blocks) plus the
router's own count of requests it sent there and has not seen finish, which is
fresher than any report. A worker marked dead is never picked.

`pick` returns a `Claim`: the request counts against the worker from the pick until
the claim is released, exactly once, by the request that holds it (see
cluster/request.py), so the count stays exact across restarts and failures.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from cluster.config import RouterPolicy
from engine.worker_messages import HealthReport


class NoLiveWorkerError(RuntimeError):
    """No live worker of a role: the request cannot be placed now."""

    def __init__(self, role: str, request_id: str | None = None):
        self.role = role
        self.request_id = request_id
        super().__init__(f"[request {request_id}] no live {role} worker")


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

    def score(self) -> tuple[float, float]:
        """Lower is better: outstanding work first, then fewer free KV blocks."""
        if self.load is None:
            return (self.in_flight, 0.0)
        free = self.load.free_blocks / max(1, self.load.total_blocks)
        return (self.load.queue_depth + self.in_flight, -free)


@dataclass
class Claim:
    """One request's hold on one worker, from `Router.pick` until `release()`."""

    worker: WorkerInfo
    released: bool = field(default=False, init=False)
    generation: int = field(default=0, init=False)
    """The worker's actor incarnation when it was picked: a failure of this request's
    calls is about that incarnation, not a replacement started since."""

    def __post_init__(self) -> None:
        self.worker.in_flight += 1
        self.generation = self.worker.generation

    def release(self) -> None:
        """Idempotent: the first call gives the worker its seat back."""
        if not self.released:
            self.released = True
            self.worker.in_flight -= 1


class Policy:
    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        raise NotImplementedError


class RoundRobin(Policy):
    def __init__(self) -> None:
        self.counter = itertools.count()

    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        return candidates[next(self.counter) % len(candidates)]


class LeastLoaded(Policy):
    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        return min(candidates, key=WorkerInfo.score)


class PowerOfTwo(Policy):
    """Two random candidates, the less loaded wins: near least-loaded at O(1) cost."""

    def __init__(self, seed: int | None = None) -> None:
        self.random = random.Random(seed)

    def choose(self, candidates: list[WorkerInfo]) -> WorkerInfo:
        if len(candidates) == 1:
            return candidates[0]
        return min(self.random.sample(candidates, 2), key=WorkerInfo.score)


POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
}


class Router:
    """Called by the request flow once per request (and again when recovering one)."""

    def __init__(self, policy: RouterPolicy, workers: dict[str, WorkerInfo]):
        self.workers = workers
        self.policies = {role: POLICIES[policy]() for role in ("prefill", "decode", "colocated")}

    def live(self, role: str) -> list[WorkerInfo]:
        """Workers of `role` that take requests (alive, and not a standby spare)."""
        return [w for w in self.workers.values() if w.role == role and w.alive and not w.standby]

    def pick(
        self, role: str, request_id: str | None = None, exclude: set[str] | None = None
    ) -> Claim:
        """A claim on the best live worker of `role`; the caller must release it."""
        candidates = [w for w in self.live(role) if w.worker_id not in (exclude or set())]
        if not candidates:
            raise NoLiveWorkerError(role, request_id)
        return Claim(self.policies[role].choose(candidates))
