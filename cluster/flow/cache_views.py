"""The driver's picture of what each worker's prefix cache holds.

Lifecycle: every health report carries the worker's cached block hashes
(`HealthReport.prefix_cache`, engine/prefix_cache.py); the first time a view is read
after a new report arrived, it takes that report's hashes as the truth. Between
reports the router adds what it knows will be cached soon: the prompt blocks of a
request it just routed to a worker, and at a request's end the prompt-plus-output
blocks its decode worker computed (the next turn of a conversation starts with them).
Those predictions expire after `PREDICTION_TTL_S` unless a report confirms them, so a
worker that evicted them stops attracting requests.

Read by the cache-aware routing policy (cluster/flow/router.py) and the disaggregation
policy (cluster/flow/disaggregation.py); single-threaded, on the driver's event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.prefix_cache import prompt_hashes, salted_root

PREDICTION_TTL_S = 30.0


@dataclass
class _View:
    report: object | None = None
    """The HealthReport these hashes came from (identity: a new one replaces them)."""
    reported: set[int] = field(default_factory=set)
    predicted: dict[int, float] = field(default_factory=dict)
    """Hash -> monotonic expiry."""


class CacheViews:
    """One per router; keyed by worker id."""

    def __init__(self, ttl_s: float = PREDICTION_TTL_S):
        self.ttl_s = ttl_s
        self.views: dict[str, _View] = {}
        self.seed: int | None = None
        self.block_size: int | None = None

    def hashes(self, tokens: list[int], workers=(), salt: str | None = None) -> list[int]:
        """The chain of `tokens`' full blocks, as every worker names them for a request
        with prefix-cache salt `salt` (after taking in the latest reports of `workers`);
        empty until a worker reported its cache, or when prefix caching is off."""
        for worker in workers:
            self._view(worker)
        if self.seed is None or self.block_size is None:
            return []
        return prompt_hashes(salted_root(self.seed, salt), tokens, self.block_size)

    def cached_blocks(self, worker, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` `worker` holds, or will once the requests
        routed to it land."""
        view = self._view(worker)
        now = time.monotonic()
        count = 0
        for block_hash in hashes:
            if block_hash not in view.reported and view.predicted.get(block_hash, 0.0) < now:
                break
            count += 1
        return count

    def note(self, worker_id: str, hashes: list[int]) -> None:
        """`worker_id` will hold these blocks (a request was routed there, or finished)."""
        view = self.views.setdefault(worker_id, _View())
        expiry = time.monotonic() + self.ttl_s
        for block_hash in hashes:
            view.predicted[block_hash] = expiry

    def note_tokens(self, worker_id: str, tokens: list[int], salt: str | None = None) -> None:
        self.note(worker_id, self.hashes(tokens, salt=salt))

    def _view(self, worker) -> _View:
        view = self.views.setdefault(worker.worker_id, _View())
        report = worker.load
        if report is not None and report is not view.report:
            view.report = report
            cache = getattr(report, "prefix_cache", None)
            view.reported = set(cache.hashes) if cache is not None else set()
            if cache is not None:
                self.seed, self.block_size = cache.seed, cache.block_size
            now = time.monotonic()
            view.predicted = {h: t for h, t in view.predicted.items() if t >= now}
        return view
