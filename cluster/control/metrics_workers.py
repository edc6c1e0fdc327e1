"""Scrape-time metric families built from the controller's last health report per worker.

On every `GET /metrics`, `ClusterMetrics.render` runs `WorkerCollector.collect`, which
reads `controller.workers` (each `WorkerInfo.load` is the worker's last `check_health`
answer, refreshed every `health_interval_s`) and yields fresh families: nothing about
a worker is stored here, so a worker that is gone simply stops having series. Families
are always declared, even empty, so dashboards and tests can rely on every name existing.
"""

from __future__ import annotations

import time

import psutil
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from cluster.control.local_head import local_head_pids
from kv_transfer.stats import SenderStats
from worker.messages import HealthReport

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WORKER = ["worker", "role"]


class WorkerCollector:
    """Registered once by `ClusterMetrics` in its registry; `collect` runs per scrape."""

    RAY_PIDS_TTL_S = 10.0
    """How long a listing of the Ray head's processes serves: listing walks the whole
    process table (~7 ms here); reading their CPU times takes ~0.3 ms."""

    def __init__(self, controller):
        self.controller = controller
        self._head_pids: set[int] = set()
        self._head_pids_listed = -float("inf")

    def collect(self):
        families = _Families()
        alive: dict[str, int] = {}
        standby: dict[str, int] = {}
        for worker in list(self.controller.workers.values()):
            routed = worker.alive and not worker.standby
            alive[worker.role] = alive.get(worker.role, 0) + int(routed)
            standby[worker.role] = standby.get(worker.role, 0) + int(
                worker.alive and worker.standby
            )
            labels = [worker.worker_id, worker.role]
            families.restarts.add_metric(labels, worker.restarts)
            if worker.alive and worker.load:
                families.add_worker(labels, worker.load)
        for role, count in sorted(alive.items()):
            families.alive.add_metric([role], count)
            families.standby.add_metric([role], standby[role])
        for role, count in sorted(self.controller.prestarted.counts().items()):
            families.prestarted.add_metric([role], count)
        families.transport.add_metric([self.controller.config.transport.name], 1)
        families.ray_cpu.add_metric([], cpu_seconds(self._ray_processes()))
        yield from families.all()

    def _ray_processes(self) -> set[int]:
        """The local head's processes, less the serving workers (those have their own
        series). The head is listed again every `RAY_PIDS_TTL_S`, so a process Ray
        starts is counted from its next listing on; the workers are left out at every
        scrape, so a prestarted process that a restart takes is never counted twice."""
        now = time.monotonic()
        if now - self._head_pids_listed > self.RAY_PIDS_TTL_S:
            self._head_pids = set(local_head_pids())
            self._head_pids_listed = now
        return self._head_pids - self.controller.worker_pids()


class _Families:
    """One scrape's families; `add_worker` adds one live worker's samples."""

    def __init__(self):
        self.alive = GaugeMetricFamily(
            "pdserve_workers_alive", "Live workers per role taking requests", labels=["role"]
        )
        self.standby = GaugeMetricFamily(
            "pdserve_workers_standby", "Warm spares per role, ready to take over", labels=["role"]
        )
        self.prestarted = GaugeMetricFamily(
            "pdserve_workers_prestarted",
            "Prestarted worker processes per role, waiting for a restart to take them",
            labels=["role"],
        )
        self.restarts = CounterMetricFamily(
            "pdserve_worker_restarts", "Times each worker was restarted", labels=WORKER
        )
        self.transport = GaugeMetricFamily(
            "pdserve_kv_transport_configured_info",
            "KV transport the cluster was configured with (compare with the transport label "
            "of pdserve_kv_transfer_bytes_total to spot a fallback)",
            labels=["transport"],
        )
        self.running = _gauge("pdserve_requests_running", "Requests in the worker's running batch")
        self.waiting = _gauge("pdserve_requests_waiting", "Requests queued at the worker")
        self.blocks_used = _gauge("pdserve_kv_blocks_used", "KV blocks in use")
        self.blocks_total = _gauge("pdserve_kv_blocks_capacity", "KV blocks in the pool")
        self.leases = _gauge(
            "pdserve_kv_leases_outstanding", "Exports holding blocks for a decode worker"
        )
        self.leased_blocks = _gauge("pdserve_kv_leased_blocks", "Blocks held by outstanding leases")
        self.expired = CounterMetricFamily(
            "pdserve_kv_leases_expired", "Leases that expired before an ack", labels=WORKER
        )
        self.prefill_batch = HistogramMetricFamily(
            "pdserve_prefill_batch_size", "Sequences prefilled per engine step", labels=WORKER
        )
        self.decode_batch = HistogramMetricFamily(
            "pdserve_decode_batch_size", "Sequences decoded per engine step", labels=WORKER
        )
        self.cache_queried = CounterMetricFamily(
            "pdserve_prefix_cache_queried_tokens",
            "Tokens looked up in the worker's prefix cache (admitted prompts, imports)",
            labels=WORKER,
        )
        self.cache_hits = CounterMetricFamily(
            "pdserve_prefix_cache_hit_tokens",
            "Of those, tokens whose KV the cache already held",
            labels=WORKER,
        )
        self.cache_hit_ratio = _gauge(
            "pdserve_prefix_cache_hit_ratio", "Prefix cache hit tokens / queried tokens so far"
        )
        self.cache_blocks = _gauge(
            "pdserve_prefix_cache_blocks", "Blocks named in the prefix cache (in use or evictable)"
        )
        self.cache_evictions = CounterMetricFamily(
            "pdserve_prefix_cache_evictions",
            "Cached blocks evicted to make room (LRU, unreferenced only)",
            labels=WORKER,
        )
        self.ray_cpu = CounterMetricFamily(
            "pdserve_ray_cpu_seconds",
            "CPU seconds used by the processes of the Ray head this server started (GCS, "
            "raylet, agents, idle worker processes), serving workers left out; 0 when it "
            "joined a running cluster",
        )
        self.cpu = CounterMetricFamily(
            "pdserve_worker_cpu_seconds",
            "CPU seconds the worker process has used, every thread (as of its last health report)",
            labels=WORKER,
        )
        self.gpu_util = _gauge("pdserve_gpu_utilization_ratio", "GPU busy fraction (NVML)")
        self.gpu_used = _gauge("pdserve_gpu_memory_used_bytes", "GPU memory used (NVML)")
        self.gpu_total = _gauge("pdserve_gpu_memory_total_bytes", "GPU memory size (NVML)")

    def add_worker(self, labels: list[str], load: HealthReport) -> None:
        self.cpu.add_metric(labels, load.cpu_s)
        self.blocks_used.add_metric(labels, load.total_blocks - load.free_blocks)
        self.blocks_total.add_metric(labels, load.total_blocks)
        self.running.add_metric(labels, load.num_running)
        self.waiting.add_metric(labels, load.num_waiting)
        if isinstance(load.transfer, SenderStats):  # the sender side: prefill workers
            self.leases.add_metric(labels, load.transfer.pinned_requests)
            self.leased_blocks.add_metric(labels, load.transfer.pinned_blocks)
            self.expired.add_metric(labels, load.transfer.expiries)
        for family, sizes in (
            (self.prefill_batch, load.batch_sizes.get("prefill")),
            (self.decode_batch, load.batch_sizes.get("decode")),
        ):
            if sizes is not None:
                family.add_metric(labels, *_histogram_of(sizes))
        cache = getattr(load, "prefix_cache", None)
        if cache is not None:
            self.cache_queried.add_metric(labels, cache.queried_tokens)
            self.cache_hits.add_metric(labels, cache.hit_tokens)
            self.cache_hit_ratio.add_metric(labels, cache.hit_tokens / max(1, cache.queried_tokens))
            self.cache_blocks.add_metric(labels, cache.cached_blocks)
            self.cache_evictions.add_metric(labels, cache.evictions)
        if load.gpu:
            self.gpu_util.add_metric(labels, load.gpu["utilization_ratio"])
            self.gpu_used.add_metric(labels, load.gpu["memory_used_bytes"])
            self.gpu_total.add_metric(labels, load.gpu["memory_total_bytes"])

    def all(self) -> list:
        return list(vars(self).values())


def cpu_seconds(pids) -> float:
    """User + system CPU seconds of the processes among `pids` that are alive."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:  # it ended since it was listed
            continue
        total += times.user + times.system
    return total


def _gauge(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, f"{doc}, per worker", labels=WORKER)


def _histogram_of(sizes: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets and sum from exact counts (batch size -> steps)."""
    buckets = [
        (str(float(bound)), float(sum(n for size, n in sizes.items() if size <= bound)))
        for bound in BATCH_BUCKETS
    ]
    buckets.append(("+Inf", float(sum(sizes.values()))))
    return buckets, float(sum(size * n for size, n in sizes.items()))
