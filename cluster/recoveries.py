"""What a request recovered from, and how its KV came back: the labels its timeline
records (`RequestTimeline.recoveries`, `recovery_paths`), `pdserve_timings` shows, and
`pdserve_request_recoveries_total` counts by `kind`.

The request flow (cluster/flow/request_flow.py) appends one `Recovery` per failure it
survived and one `RecoveryPath` per way it took to rebuild the KV. Both are `StrEnum`s
whose values are the labels dashboards and drills already read, so a metric label,
a JSON timing and a log line show the same string as before they were typed.
"""

from __future__ import annotations

import enum


class Recovery(enum.StrEnum):
    """What went wrong and was recovered from."""

    PREFILL_DIED = "prefill_died"
    DECODE_DIED = "decode_died"
    COLOCATED_DIED = "colocated_died"
    TRANSFER_FAILED = "transfer_failed"
    """The KV import failed and the decode worker recomputed the prompt."""
    DECODE_SIDE_PREFILL = "decode_side_prefill"
    """No prefill worker was alive: the decode worker prefilled the prompt."""

    @classmethod
    def died(cls, role: str) -> Recovery:
        """The worker of `role` (prefill, decode, colocated) a call went to died."""
        return cls(f"{role}_died")


class RecoveryPath(enum.StrEnum):
    """How a recovery got the request's KV back."""

    DECODE_SIDE_PREFILL = "decode_side_prefill"
    """The decode worker prefilled the prompt itself."""
    PREFILL_RETRY = "prefill_retry"
    """Prefilled again on another prefill worker."""
    REPULL = "repull"
    """The next decode worker pulled the still-pinned export again."""
    RECOMPUTE = "recompute"
    """The decode worker computed the KV itself."""
    REPREFILL = "reprefill"
    """A prefill worker whose prefix cache held the prompt exported it again."""
    STREAM_KEPT = "stream_kept"
    """A streamed import whose prefill worker died kept the segments that had landed
    (verified) and the decode worker computed only the rest."""
