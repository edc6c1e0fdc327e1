"""Prometheus metrics: one object owns every prometheus_client metric of the cluster.

A request's path through here: the frontend counts its outcome (`observe_outcome`)
when it is rejected or its stream ends; when the cluster is done with it, however it
ended, its `RequestTimeline` arrives (`observe_timeline`) and becomes latency, phase,
token and KV transfer samples. Worker state (queues, KV pool, leases, batch sizes,
liveness, GPU, CPU) is read at scrape time from the controller's last health reports by
`cluster.control.metrics_workers`. Workers themselves only collect plain stats. CPU seconds
come in three parts, so that a run's delta says who used the cores: this process
(`process_cpu_seconds_total`: the HTTP frontend and the Ray driver), each worker
(`pdserve_worker_cpu_seconds_total`) and Ray's own processes (`pdserve_ray_cpu_seconds_total`).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from cluster.control.metrics_workers import WorkerCollector
from cluster.timeline import RequestTimeline

# `_created` series double the exposition and no dashboard reads them.
disable_created_metrics()

# Sub-millisecond token gaps up to minute-long generations.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Shared-memory copies of a short prompt take well under a millisecond.
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS[:-3])
# 1 MB/s (a stalled TCP fallback) to 100 GB/s (NVLink).
BANDWIDTH_BUCKETS = (1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11)
FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
SCORE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
OUTCOMES = ("ok", "error", "rejected", "timeout", "cancelled")
ENDPOINTS = ("completions", "chat")
LINK = ("transport", "src", "dst")
# (phase, which worker it ran on, that worker's role); `breakdown()` key is `<phase>_s`.
PHASES = (
    ("prefill_queue", "prefill_worker", "prefill"),
    ("prefill", "prefill_worker", "prefill"),
    ("kv_transfer", "decode_worker", "decode"),
    ("decode_queue", "decode_worker", "decode"),
    ("decode", "decode_worker", "decode"),
)


class ClusterMetrics:
    """Created once by the frontend (`build_app`); rendered on every `GET /metrics`."""

    def __init__(self, controller=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_requests_total",
            "Requests by outcome (ok, error, rejected, timeout, cancelled) and endpoint",
            ["outcome", "endpoint"],
            registry=r,
        )
        self.ttft = _histogram(r, "pdserve_time_to_first_token_seconds", "Arrival to first token")
        self.itl = _histogram(r, "pdserve_inter_token_latency_seconds", "Gap between tokens")
        self.tpot = _histogram(
            r,
            "pdserve_time_per_output_token_seconds",
            "Decode time divided by output tokens after the first (finished requests)",
        )
        self.e2e = _histogram(
            r, "pdserve_e2e_request_latency_seconds", "Arrival to last token (finished requests)"
        )
        self.phase = _histogram(
            r,
            "pdserve_phase_seconds",
            "Time per phase: prefill_queue, prefill, kv_transfer, decode_queue, decode",
            ["phase", "worker", "role"],
        )
        self._add_transfer_metrics(r)
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens_total",
            "Prompt tokens of requests that produced tokens",
            registry=r,
        )
        self.generated_tokens = Counter(
            "pdserve_generation_tokens_total", "Tokens generated and streamed", registry=r
        )
        self.recoveries = Counter(
            "pdserve_request_recoveries_total",
            "Failures a request survived, by kind (prefill_died, decode_died, transfer_failed...)",
            ["kind"],
            registry=r,
        )
        self._add_reuse_metrics(r)
        for outcome in OUTCOMES:
            for endpoint in ENDPOINTS:
                self.requests.labels(outcome, endpoint)
        ProcessCollector(registry=r)  # process_cpu_seconds_total etc.: this frontend's own
        if controller is not None:
            r.register(WorkerCollector(controller))

    def _add_transfer_metrics(self, r: CollectorRegistry) -> None:
        self.kv_bytes = Counter(
            "pdserve_kv_transfer_bytes_total",
            "KV bytes moved per link, by the transport that actually moved them",
            LINK,
            registry=r,
        )
        self.kv_transfers = Counter(
            "pdserve_kv_transfers_total", "Successful KV transfers per link", LINK, registry=r
        )
        self.kv_seconds = _histogram(
            r, "pdserve_kv_transfer_seconds", "KV transfer duration", LINK, TRANSFER_BUCKETS
        )
        self.kv_bandwidth = _histogram(
            r,
            "pdserve_kv_transfer_bandwidth_bytes_per_second",
            "Achieved bandwidth of each KV transfer",
            LINK,
            BANDWIDTH_BUCKETS,
        )
        self.kv_recomputes = Counter(
            "pdserve_kv_recomputes_total",
            "Requests whose decode worker prefilled the prompt itself instead of receiving its "
            "KV, by link and why (a silent fallback shows up here)",
            ["src", "dst", "reason"],
            registry=r,
        )
        self.kv_hidden = _histogram(
            r,
            "pdserve_kv_transfer_hidden_seconds",
            "KV transfer time per request spent while its prompt still computed (streamed "
            "exports; 0 for whole-prompt transfers), by how the KV moved (whole, pull, push)",
            ["stream"],
            TRANSFER_BUCKETS,
        )
        self.kv_exposed = _histogram(
            r,
            "pdserve_kv_transfer_exposed_seconds",
            "KV transfer time per request after its prompt's last chunk, until the last block "
            "landed: what the link adds before decode starts, by how the KV moved",
            ["stream"],
            TRANSFER_BUCKETS,
        )
        self.kv_failures = Counter(
            "pdserve_kv_transfer_failures_total",
            "Failed KV transfers by reason (timeout, checksum, peer_died, layout_mismatch...)",
            [*LINK, "reason"],
            registry=r,
        )

    def _add_reuse_metrics(self, r: CollectorRegistry) -> None:
        self.cached_tokens = Counter(
            "pdserve_prefix_cache_cached_tokens_total",
            "Prompt tokens served from a prefix cache where the prompt was computed "
            "(usage's cached_tokens)",
            registry=r,
        )
        self.reused_blocks = Counter(
            "pdserve_kv_blocks_reused_total",
            "KV blocks a decode worker already held (its prefix cache) and did not pull",
            ["dst"],
            registry=r,
        )
        self.bytes_saved = Counter(
            "pdserve_kv_bytes_saved_total",
            "KV bytes not moved thanks to decode-side reuse",
            ["dst"],
            registry=r,
        )
        self.route_decisions = Counter(
            "pdserve_router_decisions_total",
            "cache_aware routing decisions by role and reason (cache, load, balance)",
            ["role", "reason"],
            registry=r,
        )
        self.route_overlap = Histogram(
            "pdserve_router_cached_fraction",
            "Share of the prompt's blocks the chosen worker held, per routing decision",
            ["role"],
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.route_score = Histogram(
            "pdserve_router_score_blocks",
            "The chosen worker's cache_aware score (blocks still to do + blocks claimed)",
            ["role"],
            buckets=SCORE_BUCKETS,
            registry=r,
        )
        self.paths = Counter(
            "pdserve_disaggregation_decisions_total",
            "Where prompts were prefilled (remote: prefill worker, local: decode worker) "
            "and why (always, never, auto's cheaper or unmeasured)",
            ["path", "reason"],
            registry=r,
        )

    def _observe_reuse(self, timeline: RequestTimeline) -> None:
        reuse = timeline.reuse()
        self.cached_tokens.inc(reuse["cached_tokens"])
        if reuse["decode_reused_blocks"] and timeline.decode_worker:
            self.reused_blocks.labels(timeline.decode_worker).inc(reuse["decode_reused_blocks"])
            self.bytes_saved.labels(timeline.decode_worker).inc(reuse["kv_bytes_saved"])
        for role, decision in timeline.route.items():
            self.route_decisions.labels(role, decision["reason"]).inc()
            blocks = max(1, decision["prompt_blocks"])
            self.route_overlap.labels(role).observe(decision["cached_blocks"] / blocks)
            self.route_score.labels(role).observe(decision["score"])
        if timeline.disaggregation is not None:
            choice = timeline.disaggregation
            self.paths.labels(choice["path"], choice["reason"]).inc()

    def observe_outcome(self, outcome: str, endpoint: str) -> None:
        """Called by the frontend once per request: at rejection or when its stream ends."""
        self.requests.labels(outcome, endpoint).inc()

    def observe_timeline(self, timeline: RequestTimeline) -> None:
        """Called by the cluster's `on_finish` once per request, however it ended."""
        b = timeline.breakdown()
        for kind in timeline.recoveries:
            self.recoveries.labels(kind).inc()
        self._observe_transfer(timeline, b)
        self._observe_reuse(timeline)
        if timeline.first_token is None:
            return  # rejected before any work, or failed before a token: nothing to time
        self.prompt_tokens.inc(timeline.num_prompt_tokens)
        self.generated_tokens.inc(timeline.num_output_tokens)
        self.ttft.observe(b["ttft_s"])
        for gap in timeline.inter_token_latencies():
            self.itl.observe(gap)
        if b["e2e_s"] is not None:
            self.e2e.observe(b["e2e_s"])
            if timeline.num_output_tokens > 1:
                self.tpot.observe(b["decode_s"] / (timeline.num_output_tokens - 1))
        for phase, worker_key, role in PHASES:
            value, worker = b[f"{phase}_s"], b[worker_key]
            if value is not None and worker:
                self.phase.labels(phase, worker, role).observe(value)

    def _observe_transfer(self, timeline: RequestTimeline, b: dict) -> None:
        if not timeline.transport or timeline.transfer_ok is None:
            return  # colocated, or the request never reached a KV import
        link = (timeline.transport, timeline.prefill_worker or "", timeline.decode_worker or "")
        if not timeline.transfer_ok:
            reason = timeline.transfer_failure or "unknown"
            self.kv_failures.labels(*link, reason).inc()
            if timeline.recomputed:
                self.kv_recomputes.labels(*link[1:], reason).inc()
            return
        seconds = b["kv_transfer_s"] or 0.0
        self.kv_hidden.labels(b["kv_stream"]).observe(b["kv_transfer_hidden_s"] or 0.0)
        self.kv_exposed.labels(b["kv_stream"]).observe(b["kv_transfer_exposed_s"] or 0.0)
        self.kv_bytes.labels(*link).inc(timeline.kv_bytes)
        self.kv_transfers.labels(*link).inc()
        self.kv_seconds.labels(*link).observe(seconds)
        if seconds > 0:
            self.kv_bandwidth.labels(*link).observe(timeline.kv_bytes / seconds)

    def render(self) -> bytes:
        """The whole cluster in Prometheus text format; called by `GET /metrics`."""
        return generate_latest(self.registry)


def _histogram(registry, name, doc, labels=(), buckets=LATENCY_BUCKETS) -> Histogram:
    return Histogram(name, doc, list(labels), buckets=buckets, registry=registry)
