"""What moving a migrating request's KV costs against recomputing it, from what the
cluster measured itself.

When a decode worker dies while the prompt's export is still pinned on its prefill
worker (mid-import, or before the ack landed), its replacement can either re-pull
those blocks over the KV link and compute only the tokens decided since, or prefill
prompt and decided tokens from scratch. The request flow asks `RecoveryCosts.choose`;
the cluster feeds it every finished request's measured transfer bandwidth and
prefill rate (`observe`).

Once the export is released (the import landed), the prompt's KV usually still sits in
its prefill worker's prefix cache. Prefilling the prompt again there costs only what
the cache lost, plus moving the blocks; `reprefill_pays` weighs that against the new
decode worker computing the whole prompt, next to the streams it already decodes.
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
    bytes_per_block: float | None = None
    """KV bytes of one block on the link (from the last import that moved blocks)."""

    def observe(self, timeline: RequestTimeline) -> None:
        """Called once per closed request."""
        imported, prefill = timeline.imported, timeline.prefill
        if imported is not None and imported.ok and imported.transfer_s > 0:
            self.bandwidth_bytes_per_s = _blend(
                self.bandwidth_bytes_per_s, imported.num_bytes / imported.transfer_s
            )
        if imported is not None and imported.ok and imported.moved_blocks > 0:
            self.bytes_per_block = imported.num_bytes / imported.moved_blocks
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

    def reprefill_pays(self, prompt_tokens: int, cached_tokens: int, prompt_blocks: int) -> bool:
        """Whether prefilling the prompt again on a prefill worker whose cache holds
        `cached_tokens` of it, then moving its `prompt_blocks` KV blocks, is expected
        sooner than the decode worker computing the whole prompt. With nothing measured
        yet, any cache hit decides it. (The tokens decided since are computed by the
        decode worker either way, so they cancel.)"""
        if cached_tokens <= 0:
            return False
        rate, bandwidth = self.prefill_tokens_per_s, self.bandwidth_bytes_per_s
        if rate is None or bandwidth is None or self.bytes_per_block is None:
            return True
        reprefill_s = (prompt_tokens - cached_tokens) / rate
        reprefill_s += prompt_blocks * self.bytes_per_block / bandwidth
        return reprefill_s < prompt_tokens / rate


def _blend(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - _SMOOTHING) * average + _SMOOTHING * sample
