"""How many threads a CPU forward step should use right now: measured, not assumed.

A step on N threads meets at a barrier after every parallel operation (~180 in a fused
decode step, more operation by operation). On a quiet machine two threads beat one;
but when anything else wants a core (the HTTP frontend, a Ray driver, a prefill
worker, another tenant), a thread preempted mid-phase holds its partner at the next
barrier for up to a scheduler slice, and two threads end up far slower than one
(with other jobs on a 2-core machine, a median decode step took 34 ms on one thread and
711 ms on two). So `LlamaForward` asks
`pick` before each CPU step and reports the step's wall time to `record`; per kind of
step and size bucket it keeps a moving average per thread count (the first step of a
kind, cold, is not counted), runs the faster one, and tries the other now and then,
less often each time it loses again. A kind starts on all threads; a try of more
threads comes only when other processes left the cores mostly idle meanwhile, of fewer
only when they kept some busy (or, once, when the step is short). A try is
TRIAL_STEPS steps judged by their median: one slow step (a page fault, a burst of the
frontend) would otherwise put a served engine's mixed prefill steps on one thread for
seconds. The native kernels split work by the batch, never by the threads,
so switching changes timing only; torch's own ops may round differently on another
thread count.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

FIRST_RETRY = 16
"""Steps on the faster count before the other is tried again (doubles on each loss)."""
LAST_RETRY = 256
SMOOTHING = 0.25
"""Weight of the newest step in each moving average."""
IDLE_CORES_FOR_RETRY = 0.5
"""A retry of more threads waits until about this many cores were idle meanwhile."""
BUSY_CORES_FOR_RETRY = 0.5
"""A retry of fewer threads waits until other processes kept about this many cores busy
meanwhile. Fewer threads win only when something else wants the cores; on cores left
free the count that won keeps winning, and its retries were the dearest steps of a
served run (a 500-token mixed step on one thread took 780 ms against 462 on two, three
of them per try)."""
TRIAL_STEPS = 3
"""Steps of a thread count's try; their median is its new average."""
CHEAP_TRY_S = 0.06
"""A kind of step this short on its first count has fewer threads tried once even on
cores nobody else wants: a tiny step may gain less from a second thread than its
barriers cost, and finding out costs a few ms. A longer one tries fewer threads only
under load, like every retry: on a quiet machine a fresh server's first tries of one
thread cost 3 x 156 ms (256-token mixed steps) and 3 x 310 ms (500-token ones), about
6% of a 16-stream run, and one thread won no kind of step."""


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run the block on one torch thread, then restore the caller's count.

    `LLMEngine` builds itself inside this, because the thread that builds an engine is
    often not the one that steps it (a worker's engine loop runs on its own thread), and
    libgomp keeps, for good, a pool of N - 1 threads for every thread that ever ran a
    parallel region on N. It spins at barriers only while the threads it manages are no
    more than the CPUs; past that every barrier sleeps in the kernel. An engine loaded on
    two threads and stepped on another thread thus made three managed threads on a
    2-core machine, and each of a decode step's ~180 barriers a futex round trip: 20.6
    against 12.1 ms per batch-1 bf16 step. So only the stepping thread runs parallel
    regions."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU ticks at one moment: the machine's idle and total, this process's."""

    idle: int
    total: int
    ours: float


def free_cores(before: CpuSample, after: CpuSample, cores: int) -> float | None:
    """Cores that other processes left free between two samples: idle ones plus the
    ones this process kept busy itself; None when no tick passed."""
    elapsed = after.total - before.total
    if elapsed <= 0:
        return None
    free = (after.idle - before.idle) + max(0.0, after.ours - before.ours)
    return min(float(cores), free / elapsed * cores)


def idle_cores() -> Callable[[], float | None]:
    """A probe: cores left idle by every *other* process on average since its previous
    call (from /proc/stat, less this process's own CPU time), or None where that cannot
    be read. A retry that would meet a busy core is a slow step, so the chooser looks
    before it tries. This engine's own steps do not count as busy: they are the threads
    being chosen (a served engine decodes between its prefill steps, and counting that
    as load kept a prefill bucket on one thread for good)."""
    last: list[CpuSample | None] = [None]
    ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def probe() -> float | None:
        try:
            with open("/proc/stat") as handle:
                fields = [int(v) for v in handle.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        own = os.times()
        sample = CpuSample(
            fields[3] + fields[4], sum(fields[:8]), (own.user + own.system) * ticks_per_s
        )
        previous, last[0] = last[0], sample
        return None if previous is None else free_cores(previous, sample, os.cpu_count() or 1)

    return probe


@dataclass
class _Bucket:
    average: dict[int, float] = field(default_factory=dict)
    retry_in: int = FIRST_RETRY
    countdown: int = FIRST_RETRY
    warmed: bool = False
    """The first step of this kind has run (it is not recorded)."""
    trying: int | None = None
    """The thread count being tried, for TRIAL_STEPS steps."""
    trial: list[float] = field(default_factory=list)


class ThreadChoice:
    """Owned by one `LlamaForward`; `pick` then `record` once per step, with the same key
    (the kind of step and its size, bucketed by the caller)."""

    def __init__(
        self,
        max_threads: int,
        idle_probe: Callable[[], float | None] | None = None,
        pinned: bool = False,
    ):
        """`pinned`: always `max_threads` (benchmarks that measure one count)."""
        self.counts = (1, max_threads) if max_threads > 1 and not pinned else (max_threads,)
        self.buckets: dict[object, _Bucket] = {}
        self.idle_probe = idle_probe or idle_cores()
        self.cores = os.cpu_count() or 1

    def pick(self, key) -> int:
        if len(self.counts) == 1:
            return self.counts[0]
        bucket = self.buckets.setdefault(key, _Bucket())
        if bucket.trying is not None:
            return bucket.trying
        if not bucket.average:
            self.idle_probe()  # the window the other count's first try is judged on
            return self._try(bucket, self.counts[-1])
        best = min(bucket.average, key=bucket.average.__getitem__)
        if bucket.countdown > 0:
            return best
        other = next(n for n in self.counts if n != best)
        if not self._worth_trying(bucket, other, best):
            self._lost(bucket)  # the load that would make `other` lose is still there
            return best
        return self._try(bucket, other)

    def _worth_trying(self, bucket: _Bucket, other: int, best: int) -> bool:
        never_tried = other not in bucket.average
        if never_tried and other < best and bucket.average[best] <= CHEAP_TRY_S:
            return True
        return self._retry_can_win(other > best)

    def _retry_can_win(self, more_threads: bool) -> bool:
        """More threads can win only on cores other processes left idle, fewer only when
        others keep cores busy (unknown load: try)."""
        free = self.idle_probe()
        if free is None:
            return True
        if more_threads:
            return free >= IDLE_CORES_FOR_RETRY
        return free <= self.cores - BUSY_CORES_FOR_RETRY

    def record(self, key, threads: int, seconds: float) -> None:
        if len(self.counts) == 1:
            return
        bucket = self.buckets.setdefault(key, _Bucket())
        if not bucket.warmed:
            # The first step of a kind touches fresh scratch and pool pages and is slower
            # by itself; judging by it once put a served engine's prefill on one thread
            # (2x slower) for the rest of the run.
            bucket.warmed = True
            return
        if threads == bucket.trying:
            bucket.trial.append(seconds)
            if len(bucket.trial) == TRIAL_STEPS:
                self._judge(bucket, threads)
            return
        averages = bucket.average
        previous = averages.get(threads, seconds)
        averages[threads] = previous + SMOOTHING * (seconds - previous)
        bucket.countdown -= 1

    def _try(self, bucket: _Bucket, threads: int) -> int:
        bucket.trying, bucket.trial = threads, []
        return threads

    def _judge(self, bucket: _Bucket, threads: int) -> None:
        """The try is over: its median replaces the count's stale average."""
        averages = bucket.average
        averages[threads] = statistics.median(bucket.trial)
        bucket.trying, bucket.trial = None, []
        if len(averages) < len(self.counts):
            bucket.countdown = 0  # the other count is due now, if the load lets it win
            return
        if min(averages, key=averages.__getitem__) == threads:
            bucket.retry_in = bucket.countdown = FIRST_RETRY
            self.idle_probe()
        else:
            self._lost(bucket)

    def _lost(self, bucket: _Bucket) -> None:
        bucket.retry_in = min(2 * bucket.retry_in, LAST_RETRY)
        bucket.countdown = bucket.retry_in
        self.idle_probe()  # the next retry looks at how idle the cores were from now on

    def averages(self) -> dict[object, dict[int, float]]:
        """Key -> {thread count: moving-average seconds}: what the choice is based on
        (printed by `pdserve bench engine`)."""
        return {key: dict(bucket.average) for key, bucket in self.buckets.items()}
