"""What an engine's steps cost, measured from its own step trace.

Every health report carries a `StepCosts` fitted from the engine's last steps
(`LLMEngine.step_trace`): for steps that only prefilled, seconds = fixed + per-token x
prefill tokens; for steps that only decoded, seconds = fixed + per-sequence x batch.
The driver's disaggregation policy (cluster/flow/disaggregation.py) predicts from it how
long a prompt takes to prefill on a given worker. Mixed steps are left out: their
split between the two kinds is not identifiable from one duration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

FIT_STEPS = 256
"""The most recent steps a fit uses."""


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step, by kind; a `None` pair means no step of that kind ran yet."""

    prefill_fixed_s: float | None = None
    prefill_token_s: float | None = None
    decode_fixed_s: float | None = None
    decode_seq_s: float | None = None
    prefill_steps: int = 0
    decode_steps: int = 0

    def prefill_s(self, tokens: int) -> float | None:
        """Predicted time of a step prefilling `tokens` tokens (None: never measured)."""
        if self.prefill_token_s is None:
            return None
        return (self.prefill_fixed_s or 0.0) + self.prefill_token_s * tokens


def fit_step_costs(records: Iterable, last: int = FIT_STEPS) -> StepCosts:
    """Called by the health report with the engine's `step_trace` (a deque the engine
    thread appends to; `list` copies it in one call)."""
    recent = list(records)[-last:]
    prefill = [
        (r.prefill_tokens, r.seconds) for r in recent if r.prefill_tokens and not r.decode_seqs
    ]
    decode = [(r.decode_seqs, r.seconds) for r in recent if r.decode_seqs and not r.prefill_seqs]
    prefill_fixed, per_token = _affine(prefill)
    decode_fixed, per_seq = _affine(decode)
    return StepCosts(prefill_fixed, per_token, decode_fixed, per_seq, len(prefill), len(decode))


def _affine(samples: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    """Least-squares (fixed, slope) with both kept non-negative; with one size only,
    all of the time is put on the slope (an upper bound per unit)."""
    if not samples:
        return None, None
    sizes = np.array([s for s, _ in samples], dtype=float)
    seconds = np.array([t for _, t in samples], dtype=float)
    if np.ptp(sizes) == 0:
        return 0.0, float(seconds.mean() / sizes.mean())
    slope, fixed = np.polyfit(sizes, seconds, 1)
    if fixed < 0 or slope <= 0:  # noise: a line through the origin instead
        return 0.0, float((sizes @ seconds) / (sizes @ sizes))
    return float(fixed), float(slope)
