"""Percentiles and distribution summaries, defined once for every benchmark.

Percentiles interpolate linearly between the two nearest ranks (numpy's default,
which `vllm bench serve` also uses), so p50 of [1, 2, 3, 4] is 2.5 and two tools fed
the same samples print the same figure.
"""

from __future__ import annotations

import math
import statistics

QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, or None when there are none."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: list[float], prefix: str) -> dict[str, float | None]:
    """`{prefix}_mean_s`, `_p50_s`, `_p90_s`, `_p99_s` of `values` (None when empty)."""
    summary = {f"{prefix}_mean_s": statistics.fmean(values) if values else None}
    for q in QUANTILES:
        summary[f"{prefix}_p{q}_s"] = percentile(values, q)
    return summary


def spread(values: list[float]) -> dict[str, float] | None:
    """min / median / max across repeated runs of one figure (Nones dropped)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"min": min(present), "median": statistics.median(present), "max": max(present)}
