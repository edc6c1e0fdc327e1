"""What the engines' own measured rates allow a closed-loop workload to reach.

The yardstick for the serving path: after a run, each worker's step trace
(`/admin/steps`) is fitted as step seconds = fixed + per prefill token x tokens + per
decode sequence x sequences (least squares over every step, mixed ones included), and
the output tokens/s the fitted engines could sustain for the workload (prompt P,
output O tokens, concurrency C) is computed:

  * disaggregated: the prefill workers take P tokens per request, the decode workers
    decode batches of C; the slower side bounds it:
        min(prefill_workers / prefill_s(P), decode_workers / (O x decode_step_s(C) / C)) x O
  * colocated: one engine does both, so a request costs prefill_s(P) + O x step_s(C) / C
    of it: colocated_workers x O / that.

Anything the serving path loses between the engines and the client (Ray, the frontend,
scheduling gaps, CPU stolen from the engines) shows up as the measured figure falling
short of this bound.
"""

from __future__ import annotations

import numpy as np


def fit(steps: list[dict]) -> tuple[float, float, float] | None:
    """(fixed s, s per prefill token, s per decode sequence), or None without steps."""
    rows = [s for s in steps if s["prefill_tokens"] or s["decode_seqs"]]
    if len(rows) < 3:
        return None
    design = np.array([[1.0, s["prefill_tokens"], s["decode_seqs"]] for s in rows])
    seconds = np.array([s["seconds"] for s in rows])
    solution, *_ = np.linalg.lstsq(design, seconds, rcond=None)
    return tuple(float(max(0.0, v)) for v in solution)


def _step(costs: tuple[float, float, float], prefill_tokens: int, decode_seqs: int) -> float:
    fixed, per_token, per_seq = costs
    return fixed + per_token * prefill_tokens + per_seq * decode_seqs


def output_bound(traces: dict[str, list[dict]], prompt: int, output: int, concurrency: int):
    """Output tokens/s the traced engines allow; None when a role has no fit."""
    by_role: dict[str, list[tuple[float, float, float]]] = {}
    for worker, steps in traces.items():
        costs = fit(steps)
        if costs is not None:
            by_role.setdefault(worker.rsplit("-", 1)[0], []).append(costs)
    if "colocated" in by_role:
        share = concurrency / len(by_role["colocated"])  # streams per worker
        per_request = [
            _step(c, prompt, 0) + output * _step(c, 0, share) / share for c in by_role["colocated"]
        ]
        return sum(output / s for s in per_request)
    if "prefill" not in by_role or "decode" not in by_role:
        return None
    prefill_req_s = sum(1.0 / _step(c, prompt, 0) for c in by_role["prefill"])
    share = concurrency / len(by_role["decode"])
    decode_tok_s = sum(share / _step(c, 0, share) for c in by_role["decode"])
    return min(prefill_req_s * output, decode_tok_s)
