"""From per-request records to the figures a report shows, with their definitions.

Called by the runner once per measured run (warm-up records never reach it). Every
request that was sent stays in the denominators: a failed one counts in `requests`,
lowers the goodput share, and adds no tokens. Latency distributions are over the
requests that completed.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from bench.loadgen import RequestRecord
from bench.stats import distribution

METRIC_DEFINITIONS = {
    "TTFT": "time to first token: request sent -> first chunk carrying text, at the client",
    "ITL": "inter-token latency: the gap between consecutive text chunks of a stream",
    "TPOT": "time per output token: (E2E - TTFT) / (output tokens - 1), one value per request",
    "E2E": "end to end: request sent -> [DONE]",
    "output tok/s": "output tokens of completed requests / measured duration",
    "total tok/s": "(prompt + output tokens) of completed requests / duration: INCLUDES PROMPT "
    "TOKENS",
    "goodput": "completed requests meeting every --slo bound, per second and as a share of all "
    "requests sent",
    "network + delivery": "client TTFT - the server's own TTFT (pdserve_timings.ttft_s)",
}
NAMING_NOTE = "Names differ between tools: guidellm and aiperf call TPOT 'ITL'; vLLM's ITL is ours."
SERVER_PHASES = ("prefill_queue", "prefill", "kv_transfer", "decode_queue", "ttft", "decode")
SLO_KEYS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2e_ms": "e2e"}


@dataclass(frozen=True)
class Slo:
    """Latency bounds a request must all meet to count as good (seconds; None = unbounded)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Slo | None:
        """`ttft_ms=500,tpot_ms=50,e2e_ms=10000` (any subset) -> Slo."""
        if not text:
            return None
        bounds = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            if key.strip() not in SLO_KEYS or not value:
                raise ValueError(f"--slo takes ttft_ms=, tpot_ms=, e2e_ms=; got {item!r}")
            bounds[f"{SLO_KEYS[key.strip()]}_s"] = float(value) / 1000
        return cls(**bounds)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        checks = ((self.ttft_s, record.ttft_s), (self.tpot_s, record.tpot_s or 0.0))
        checks += ((self.e2e_s, record.e2e_s),)
        return all(
            bound is None or (value is not None and value <= bound) for bound, value in checks
        )

    def describe(self) -> str:
        parts = [
            f"{name} <= {bound * 1000:g} ms"
            for name, bound in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s), ("E2E", self.e2e_s))
            if bound is not None
        ]
        return ", ".join(parts)


def summarize(
    records: list[RequestRecord], duration_s: float, slo: Slo | None = None, client_cpu_s=None
) -> dict:
    """The flat summary dict of one measured run (keys end in _s for seconds)."""
    done = [r for r in records if r.ok]
    summary = {**_counts(records), "duration_s": duration_s}
    summary.update(_throughput(done, duration_s))
    summary.update(distribution([r.ttft_s for r in done if r.ttft_s is not None], "ttft"))
    summary.update(distribution([gap for r in done for gap in r.itl_s], "itl"))
    summary.update(distribution([r.tpot_s for r in done if r.tpot_s is not None], "tpot"))
    summary.update(distribution([r.e2e_s for r in done], "e2e"))
    queued = [r.queued_s for r in records if r.queued_s is not None]
    if any(queued):
        summary.update(distribution(queued, "client_queue"))
    if slo is not None:
        summary.update(goodput(records, slo, duration_s))
    summary.update(server_breakdown(done))
    if client_cpu_s is not None:
        summary["client_cpu_s"] = client_cpu_s
        summary["client_cpu_share"] = client_cpu_s / duration_s if duration_s else None
    return summary


def _counts(records: list[RequestRecord]) -> dict:
    outcomes = Counter(r.outcome for r in records)
    statuses = Counter(str(r.status) for r in records if r.outcome == "error" and r.status != 200)
    return {
        "requests": len(records),
        "ok": outcomes["ok"],
        "error": outcomes["error"],
        "timeout": outcomes["timeout"],
        "cancelled": outcomes["cancelled"],
        "failed": len(records) - outcomes["ok"],
        "errors_by_status": dict(statuses),
    }


def _throughput(done: list[RequestRecord], duration_s: float) -> dict:
    output = sum(r.completion_tokens for r in done)
    prompt = sum(_prompt_tokens(r) for r in done)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "prompt_tokens": prompt,
        "output_tokens": output,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output),
        "total_token_throughput": per_s(prompt + output),
    }


def _prompt_tokens(record: RequestRecord) -> int:
    if record.server_prompt_tokens is not None:
        return record.server_prompt_tokens
    return record.prompt_tokens or 0


def goodput(records: list[RequestRecord], slo: Slo, duration_s: float) -> dict:
    good = sum(1 for r in records if slo.met_by(r))
    return {
        "slo": slo.describe(),
        "good_requests": good,
        "goodput_req_s": good / duration_s if duration_s > 0 else 0.0,
        "goodput_share": good / len(records) if records else 0.0,
    }


def server_breakdown(done: list[RequestRecord]) -> dict:
    """Means of the server's per-request phases, and what the client adds on top."""
    timed = [r for r in done if r.server_timings]
    if not timed:
        return {}
    breakdown = {}
    for phase in SERVER_PHASES:
        values = [r.server_timings.get(f"{phase}_s") for r in timed]
        values = [v for v in values if v is not None]
        breakdown[f"server_{phase}_mean_s"] = statistics.fmean(values) if values else None
    remainders = [
        r.ttft_s - r.server_timings["ttft_s"]
        for r in timed
        if r.ttft_s is not None and r.server_timings.get("ttft_s") is not None
    ]
    breakdown.update(distribution(remainders, "network_delivery"))
    breakdown["server_timed_requests"] = len(timed)
    return breakdown
