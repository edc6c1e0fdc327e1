"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def best_of(fn: Callable[[], object], repeats: int = 3) -> float:
    """Fastest wall time of `repeats` calls: the least noisy estimate on a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def median_of(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall time of `repeats` calls (what docs/benchmarks.md records)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 256 << 20) -> float:
    """Bytes per second of a large tensor copy (each byte read once and written once)."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return num_bytes / best_of(lambda: dst.copy_(src), repeats=5)


def load_average() -> float:
    """One-minute load average: recorded next to every figure on a shared machine."""
    try:
        with open("/proc/loadavg") as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
