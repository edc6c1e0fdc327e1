"""What moving a migrating request's KV costs against recomputing it, from what the
cluster measured itself.

When a decode worker dies while the prompt's export is still pinned on its prefill
worker (mid-import, or before the ack landed), its replacement can either re-pull
those blocks over the KV link and compute only the tokens decided since, or prefill
prompt and decided tokens from scratch. The request flow asks `RecoveryCosts.choose`;
the cluster feeds it every finished request's measured transfer bandwidth and
prefill rate (`observe`).

Once the export is released (the import landed), the KV is rebuilt instead: where,
the prefill worker whose cache still holds the prompt or the new decode worker, is the
disaggregation policy's call (`RequestFlow._rebuild_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.timeline import RequestTimeline

_SMOOTHING = 0.2
"""Weight of the newest sample in the running averages."""


@dataclass
class RecoveryCosts:
    bandwidth_bytes_per_s: float | None = None
    """Running average of KV transfers' achieved bandwidth."""
    prefill_tokens_per_s: float | None = None
    """Running average of prefill throughput per request."""

    def observe(self, timeline: RequestTimeline) -> None:
        """Called once per closed request."""
        imported, prefill = timeline.imported, timeline.prefill
        if imported is not None and imported.ok and imported.transfer_s > 0:
            self.bandwidth_bytes_per_s = _blend(
                self.bandwidth_bytes_per_s, imported.num_bytes / imported.transfer_s
            )
        if prefill is not None and prefill.prefill_s > 0:
            self.prefill_tokens_per_s = _blend(
                self.prefill_tokens_per_s, prefill.num_prompt_tokens / prefill.prefill_s
            )

    def choose(self, prompt_tokens: int, decided_tokens: int, kv_bytes: int) -> str:
        """`repull` or `recompute`: whichever is expected to resume the stream sooner.
        With nothing measured yet, re-pulling wins (bytes are cheaper than compute on
        every link pdserve runs on)."""
        if self.bandwidth_bytes_per_s is None or self.prefill_tokens_per_s is None:
            return "repull"
        repull_s = kv_bytes / self.bandwidth_bytes_per_s
        repull_s += decided_tokens / self.prefill_tokens_per_s
        recompute_s = (prompt_tokens + decided_tokens) / self.prefill_tokens_per_s
        return "repull" if repull_s < recompute_s else "recompute"


def _blend(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - _SMOOTHING) * average + _SMOOTHING * sample
