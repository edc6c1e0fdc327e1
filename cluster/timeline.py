"""Per-request phase timings and the breakdown users see as `pdserve_timings`.

Every stamp here is the driver's own `time.monotonic()`: arrival, each worker call
sent and answered, the import event received, each token, finish. Workers report how
long their phases took on their own monotonic clocks (`PrefillResult.queue_s`, ...,
`ImportEvent.transfer_s`), never a wall-clock time, so a worker whose clock is off by
seconds cannot shift or hide a phase: the driver places each worker's durations
inside the span it measured itself around that call, and what is left of the span is
the call's overhead (Ray, the network, the worker's event loop).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from cluster.recoveries import Recovery, RecoveryPath
from worker.messages import ImportEvent, PrefillResult


@dataclass
class RequestTimeline:
    request_id: str
    arrival: float
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill_sent: float | None = None
    prefill_answered: float | None = None
    prefill: PrefillResult | None = None
    decode_sent: float | None = None
    import_received: float | None = None
    imported: ImportEvent | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    transport: str | None = None
    kv_bytes: int = 0
    transfer_ok: bool | None = None
    transfer_failure: str | None = None
    """`FailureReason` value when the KV import failed."""
    recomputed: bool = False
    recoveries: list[Recovery] = field(default_factory=list)
    """What went wrong and was recovered from: prefill_died, decode_died, transfer_failed..."""
    recovery_paths: list[RecoveryPath] = field(default_factory=list)
    """How each recovery got the KV back: repull, recompute, decode_side_prefill."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens: int | None = None
    """Prompt tokens taken from a prefix cache where the prompt was computed (the prefill
    worker, or the decode worker when it prefilled): usage's `cached_tokens`."""
    kv_block_bytes: int = 0
    """Bytes of one KV block (from the export ticket's layout)."""
    route: dict = field(default_factory=dict)
    """Role -> the cache-aware router's decision (`cluster.router.RouteDecision` as a dict)."""
    disaggregation: dict | None = None
    """How the prompt's KV was to be made: `cluster.disaggregation.PathChoice` as a dict."""
    kv_stream: str = "whole"
    """How its KV moved (`worker.messages.KVStream`): whole, pull (segments) or push."""

    # --- stamps, from the request flow ------------------------------------------------

    def on_prefill(self, sent: float, answered: float, result: PrefillResult) -> None:
        self.prefill_sent, self.prefill_answered, self.prefill = sent, answered, result
        self.prefill_worker = result.worker_id
        self.cached_tokens = min(result.first.num_cached_tokens, self.num_prompt_tokens)
        block_nbytes = getattr(result.ticket, "block_nbytes", None)  # over every rank's pool
        if block_nbytes is not None:
            self.kv_block_bytes = block_nbytes

    def on_import(self, sent: float, received: float, event: ImportEvent) -> None:
        self.decode_sent, self.import_received, self.imported = sent, received, event
        self.transport = event.transport
        self.kv_bytes = event.num_bytes
        self.transfer_ok = event.ok
        self.transfer_failure = event.reason

    def on_local_prefill(self, num_cached_tokens: int) -> None:
        """The decode worker computed the prompt's KV itself, reusing this many tokens."""
        if self.cached_tokens is None:
            self.cached_tokens = min(num_cached_tokens, self.num_prompt_tokens)

    def stamp_token(self, now: float, count: int = 1) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_times.extend([now] * count)

    # --- what users see ---------------------------------------------------------------

    def breakdown(self) -> dict:
        """Seconds per phase (None where a phase did not happen), plus what moved where.
        `ttft_parts` tiles `ttft_s`: its values add up to it."""
        prefill, imported = self.prefill, self.imported
        return {
            "prefill_queue_s": prefill.queue_s if prefill else None,
            "prefill_s": prefill.prefill_s if prefill else None,
            "decode_queue_s": imported.admission_s if imported else None,
            "kv_transfer_s": imported.transfer_s if imported else None,
            **self.overlap(),
            "ttft_s": _span(self.arrival, self.first_token),
            "ttft_parts": self.ttft_parts(),
            "decode_s": _span(self.first_token, self.finish),
            "e2e_s": _span(self.arrival, self.finish),
            "kv_bytes": self.kv_bytes,
            "transport": self.transport,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "recomputed": self.recomputed,
            "recoveries": list(self.recoveries),
            "recovery_paths": list(self.recovery_paths),
            "transfer_failure": self.transfer_failure,
            "kv_slices": [dataclasses.asdict(s) for s in imported.slices] if imported else [],
            **self.reuse(),
            "route": dict(self.route),
            "disaggregation": self.disaggregation,
        }

    def overlap(self) -> dict:
        """How much of the KV transfer the prefill's compute hid: `kv_transfer_hidden_s`
        ran while the prefill worker still computed the prompt (streamed exports only),
        `kv_transfer_exposed_s` after its last chunk, until the last block landed: what
        the link still adds before decode can start. Whole-prompt transfers expose all."""
        imported = self.imported
        if imported is None:
            return {
                "kv_stream": self.kv_stream,
                "kv_transfer_hidden_s": None,
                "kv_transfer_exposed_s": None,
                "kv_stream_segments": 0,
            }
        receipt = imported.stream
        return {
            "kv_stream": self.kv_stream,
            "kv_transfer_hidden_s": receipt.hidden_s if receipt else 0.0,
            "kv_transfer_exposed_s": receipt.exposed_s if receipt else imported.transfer_s,
            "kv_stream_segments": receipt.segments if receipt else int(imported.moved_blocks > 0),
            **(
                {"kv_stream_kept_blocks": receipt.kept_blocks}
                if receipt is not None and receipt.kept_blocks
                else {}
            ),
        }

    def reuse(self) -> dict:
        """What the prefix caches saved: tokens not computed, blocks not moved."""
        imported = self.imported
        reused = imported.reused_blocks if imported else 0
        return {
            "cached_tokens": self.cached_tokens or 0,
            "prefill_cached_tokens": self.prefill.first.num_cached_tokens if self.prefill else 0,
            "decode_reused_blocks": reused,
            "kv_blocks_moved": imported.moved_blocks if imported else 0,
            "kv_bytes_saved": reused * self.kv_block_bytes,
        }

    def ttft_parts(self) -> dict[str, float]:
        """The driver's spans up to the first token, each split into the worker's own
        phases and the call's overhead. Empty until the first token."""
        if self.first_token is None:
            return {}
        parts: dict[str, float] = {}
        cursor = self.arrival
        calls = [
            (self.prefill_sent, self.prefill_answered, "prefill", self._prefill_phases()),
            (self.decode_sent, self.import_received, "import", self._import_phases()),
        ]
        for sent, answered, name, phases in calls:
            if sent is None or answered is None or answered > self.first_token:
                continue
            if sent < cursor:  # a streamed import, sent with the prefill: what it added
                parts[f"{name}_after_prefill_s"] = answered - cursor
                cursor = answered
                continue
            parts[f"before_{name}_s"] = sent - cursor
            parts.update(phases)
            parts[f"{name}_call_overhead_s"] = (answered - sent) - sum(phases.values())
            cursor = answered
        parts["until_first_token_s"] = self.first_token - cursor
        return parts

    def _prefill_phases(self) -> dict[str, float]:
        p = self.prefill
        if p is None:
            return {}
        return {"prefill_queue_s": p.queue_s, "prefill_s": p.prefill_s, "export_s": p.export_s}

    def _import_phases(self) -> dict[str, float]:
        i = self.imported
        if i is None:
            return {}
        return {"decode_queue_s": i.admission_s, "kv_transfer_s": i.transfer_s}

    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return end - start
