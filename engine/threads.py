"""How many threads a CPU forward step should use right now: measured, not assumed.

A step on N threads meets at a barrier after every parallel operation (~180 in a fused
decode step, more operation by operation). On a quiet machine two threads beat one;
but when anything else wants a core (the HTTP frontend, a Ray driver, a prefill
worker, another tenant), a thread preempted mid-phase holds its partner at the next
barrier for up to a scheduler slice, and two threads end up far slower than one
(measured on the 2-core EPYC with other jobs on the machine: median decode step 34 ms
on one thread, 711 ms on two; prefill 300 vs 123 tok/s). So `LlamaForward` asks
`pick` before each CPU step and reports the step's wall time to `record`; per kind of
step and size bucket it keeps a moving average per thread count, runs the faster one,
and retries the other now and then, less often each time it loses again. The native
kernels split work by the batch, never by the threads, so switching changes timing
only; torch's own ops may round differently on another thread count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_RETRY = 16
"""Steps on the faster count before the other is tried again (doubles on each loss)."""
LAST_RETRY = 256
SMOOTHING = 0.25
"""Weight of the newest step in each moving average."""


@dataclass
class _Bucket:
    average: dict[int, float] = field(default_factory=dict)
    retry_in: int = FIRST_RETRY
    countdown: int = FIRST_RETRY


class ThreadChoice:
    """Owned by one `LlamaForward`; `pick` then `record` once per step, with the same key
    (the kind of step and its size, bucketed by the caller)."""

    def __init__(self, max_threads: int):
        self.counts = (1, max_threads) if max_threads > 1 else (1,)
        self.buckets: dict[object, _Bucket] = {}

    def pick(self, key) -> int:
        if len(self.counts) == 1:
            return 1
        bucket = self.buckets.setdefault(key, _Bucket())
        untried = [n for n in self.counts if n not in bucket.average]
        if untried:
            return untried[-1]
        best = min(self.counts, key=bucket.average.__getitem__)
        if bucket.countdown <= 0:
            return next(n for n in self.counts if n != best)
        return best

    def record(self, key, threads: int, seconds: float) -> None:
        if len(self.counts) == 1:
            return
        bucket = self.buckets.setdefault(key, _Bucket())
        averages = bucket.average
        best = min(averages, key=averages.__getitem__, default=threads)
        if threads == best:
            previous = averages.get(threads, seconds)
            averages[threads] = previous + SMOOTHING * (seconds - previous)
            bucket.countdown -= 1
            return
        # A try of the other count: its old average is stale, this step is the news.
        averages[threads] = seconds
        won = min(averages, key=averages.__getitem__) == threads
        bucket.retry_in = FIRST_RETRY if won else min(2 * bucket.retry_in, LAST_RETRY)
        bucket.countdown = bucket.retry_in

    def averages(self) -> dict[object, dict[int, float]]:
        """Key -> {thread count: moving-average seconds}: what the choice is based on
        (printed by `pdserve bench engine`)."""
        return {key: dict(bucket.average) for key, bucket in self.buckets.items()}
