"""Prometheus metrics: one object owns every prometheus_client metric of the cluster.

Workers only collect plain stats (health reports, transfer counters, timelines); the
frontend process turns them into metrics here: request outcomes and timelines as they
finish, worker gauges (KV blocks, queue depth, liveness) at scrape time.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from cluster.timeline import RequestTimeline

# `_created` series double the exposition and no dashboard reads them.
disable_created_metrics()

# Latency buckets spanning sub-millisecond token gaps to minute-long generations.
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
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OUTCOMES = ("ok", "error", "rejected", "timeout", "cancelled")


class ClusterMetrics:
    """Created by the frontend; fed by request handlers and by the cluster's observers."""

    def __init__(self, controller=None):
        self.registry = CollectorRegistry()
        self.controller = controller
        r = self.registry
        self.requests = Counter(
            "pdserve_requests_total",
            "Requests by outcome and endpoint",
            ["outcome", "endpoint"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Server-side time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Gap between consecutive tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Decode time divided by output tokens after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "pdserve_phase_seconds",
            "Time per phase (prefill_queue, prefill, kv_transfer, decode_queue, decode)",
            ["phase", "worker", "role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Counter(
            "pdserve_kv_transfer_bytes_total",
            "KV bytes moved between workers",
            ["transport", "src", "dst"],
            registry=r,
        )
        self.kv_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "KV transfer duration",
            ["transport", "src", "dst"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_failures = Counter(
            "pdserve_kv_transfer_failures_total",
            "Failed KV transfers",
            ["transport", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens_total", "Prompt tokens processed", registry=r
        )
        self.generated_tokens = Counter(
            "pdserve_generation_tokens_total", "Tokens generated", registry=r
        )
        self.recomputed = Counter(
            "pdserve_requests_recomputed_total",
            "Requests whose KV was recomputed after a failed transfer",
            registry=r,
        )
        for outcome in OUTCOMES:
            for endpoint in ("completions", "chat"):
                self.requests.labels(outcome, endpoint)
        if controller is not None:
            r.register(_WorkerCollector(controller))

    def observe_outcome(self, outcome: str, endpoint: str) -> None:
        self.requests.labels(outcome, endpoint).inc()

    def observe_timeline(self, timeline: RequestTimeline) -> None:
        """Called once per request that produced tokens, when it ends."""
        b = timeline.breakdown()
        self.prompt_tokens.inc(timeline.num_prompt_tokens)
        self.generated_tokens.inc(timeline.num_output_tokens)
        if b["ttft_s"] is not None:
            self.ttft.observe(b["ttft_s"])
        if b["e2e_s"] is not None:
            self.e2e.observe(b["e2e_s"])
        for gap in timeline.inter_token_latencies():
            self.itl.observe(gap)
        if b["decode_s"] is not None and timeline.num_output_tokens > 1:
            self.tpot.observe(b["decode_s"] / (timeline.num_output_tokens - 1))
        self._observe_phases(timeline, b)

    def _observe_phases(self, timeline: RequestTimeline, b: dict) -> None:
        prefill, decode = timeline.prefill_worker or "", timeline.decode_worker or ""
        phases = [
            ("prefill_queue", prefill, "prefill"),
            ("prefill", prefill, "prefill"),
            ("kv_transfer", decode, "decode"),
            ("decode_queue", decode, "decode"),
            ("decode", decode, "decode"),
        ]
        for phase, worker, role in phases:
            value = b[f"{phase}_s"]
            if value is not None:
                self.phase.labels(phase, worker, role).observe(value)
        if timeline.transport:
            link = (timeline.transport, prefill, decode)
            if timeline.transfer_ok:
                self.kv_bytes.labels(*link).inc(timeline.kv_bytes)
                self.kv_seconds.labels(*link).observe(b["kv_transfer_s"] or 0.0)
            else:
                self.kv_failures.labels(timeline.transport, "transfer").inc()
        if timeline.recomputed:
            self.recomputed.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerCollector:
    """Scrape-time gauges from the controller's latest health reports."""

    def __init__(self, controller):
        self.controller = controller

    def collect(self):
        alive = GaugeMetricFamily("pdserve_workers_alive", "Live workers per role", labels=["role"])
        used = GaugeMetricFamily(
            "pdserve_kv_blocks_used", "KV blocks in use", labels=["worker", "role"]
        )
        total = GaugeMetricFamily(
            "pdserve_kv_blocks_total", "KV blocks in the pool", labels=["worker", "role"]
        )
        queue = GaugeMetricFamily(
            "pdserve_worker_queue_depth", "Requests queued or running", labels=["worker", "role"]
        )
        counts: dict[str, int] = {}
        for worker in list(self.controller.workers.values()):
            counts[worker.role] = counts.get(worker.role, 0) + int(worker.alive)
            load = worker.load or {}
            if worker.alive and "total_blocks" in load:
                labels = [worker.worker_id, worker.role]
                used.add_metric(labels, load["total_blocks"] - load["free_blocks"])
                total.add_metric(labels, load["total_blocks"])
                queue.add_metric(labels, load.get("queue_depth", 0))
        for role, count in counts.items():
            alive.add_metric([role], count)
        yield from (alive, used, total, queue)
