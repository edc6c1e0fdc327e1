"""Per-request phase timestamps and the breakdown users see as `pdserve_timings`.

The request flow stamps wall-clock times as the request moves: arrival, prefill queue
(start/end), prefill end, KV transfer (start/end), decode admission end, first token,
each token, finish. Workers stamp their own phases and return them with their results.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class RequestTimeline:
    request_id: str
    arrival: float
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill_queue_start: float | None = None
    prefill_queue_end: float | None = None
    prefill_end: float | None = None
    decode_queue_start: float | None = None
    decode_queue_end: float | None = None
    transfer_start: float | None = None
    transfer_end: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    transport: str | None = None
    kv_bytes: int = 0
    transfer_ok: bool | None = None
    transfer_failure: str | None = None
    """`FailureReason` value when the KV import failed."""
    recomputed: bool = False
    recoveries: list[str] = field(default_factory=list)
    """What went wrong and was recovered from: prefill_died, decode_died, transfer_failed..."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    def stamp_token(self, now: float, count: int = 1) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_times.extend([now] * count)

    def breakdown(self) -> dict:
        """Seconds per phase (None where a phase did not happen), plus what moved where."""
        return {
            "prefill_queue_s": _span(self.prefill_queue_start, self.prefill_queue_end),
            "prefill_s": _span(self.prefill_queue_end, self.prefill_end),
            "decode_queue_s": _span(self.decode_queue_start, self.decode_queue_end),
            "kv_transfer_s": _span(self.transfer_start, self.transfer_end),
            "ttft_s": _span(self.arrival, self.first_token),
            "decode_s": _span(self.first_token, self.finish),
            "e2e_s": _span(self.arrival, self.finish),
            "kv_bytes": self.kv_bytes,
            "transport": self.transport,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "recomputed": self.recomputed,
            "recoveries": list(self.recoveries),
            "transfer_failure": self.transfer_failure,
        }

    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, end - start)
