"""Picks a (prefill, decode) pair per request from the live membership.

Policies see each worker's last health report (queue depth, free blocks) plus the
router's own count of requests it sent there and has not seen finish, which is
fresher than any report. A worker marked dead is never picked.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from cluster.config import RouterPolicy


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
    load: dict = field(default_factory=dict)
    in_flight: int = 0
    restarts: int = 0

    def score(self) -> tuple[float, float]:
        """Lower is better: outstanding work first, then fewer free KV blocks."""
        queue = self.load.get("queue_depth", 0) + self.in_flight
        free = self.load.get("free_blocks", 0) / max(1, self.load.get("total_blocks", 1))
        return (queue, -free)


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
        return [w for w in self.workers.values() if w.role == role and w.alive]

    def pick(
        self, role: str, request_id: str | None = None, exclude: set[str] | None = None
    ) -> WorkerInfo:
        candidates = [w for w in self.live(role) if w.worker_id not in (exclude or set())]
        if not candidates:
            raise NoLiveWorkerError(role, request_id)
        return self.policies[role].choose(candidates)
