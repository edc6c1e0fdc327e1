"""The server's own Prometheus metrics around a measured run: scrape, delta, digest.

The runner scrapes `GET /metrics` right before the first measured request and right
after the last one ends. The stored delta holds counters and histogram sums/counts
(after - before) and gauges as they were at the end; buckets are dropped to keep the
JSON small. `digest` turns a delta into the few figures `pdserve bench compare` puts
side by side: batch sizes, queue and prefill times, KV transfer, recomputations, for
pdserve's metric names and for vLLM's. A server without `/metrics` gives None.
"""

from __future__ import annotations

import re

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# label -> (sum series, count series) of a mean, or a counter delta; first name found wins.
_MEANS = {
    "prefill batch size": ["pdserve_prefill_batch_size"],
    "decode batch size": ["pdserve_decode_batch_size"],
    "tokens per engine step": ["vllm:iteration_tokens_total"],
    "prefill queue (s)": ['pdserve_phase_seconds{phase="prefill_queue"}'],
    "queue time (s)": ["vllm:request_queue_time_seconds"],
    "prefill (s)": ['pdserve_phase_seconds{phase="prefill"}', "vllm:request_prefill_time_seconds"],
    "KV transfer (s)": ["pdserve_kv_transfer_seconds"],
    "decode queue (s)": ['pdserve_phase_seconds{phase="decode_queue"}'],
    "decode (s)": ['pdserve_phase_seconds{phase="decode"}', "vllm:request_decode_time_seconds"],
    "server TTFT (s)": [
        "pdserve_time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds",
    ],
}
_COUNTERS = {
    "requests ok": ['pdserve_requests_total{outcome="ok"}', "vllm:request_success_total"],
    "requests failed": [
        'pdserve_requests_total{outcome="error"}',
        'pdserve_requests_total{outcome="timeout"}',
        'pdserve_requests_total{outcome="rejected"}',
    ],
    "prompt tokens": ["pdserve_prompt_tokens_total", "vllm:prompt_tokens_total"],
    "generated tokens": ["pdserve_generation_tokens_total", "vllm:generation_tokens_total"],
    "KV bytes moved": ["pdserve_kv_transfer_bytes_total"],
    "recoveries / recomputations": [
        "pdserve_request_recoveries_total",
        "vllm:num_preemptions_total",
    ],
    "prefix cache hits (tokens)": ["vllm:prefix_cache_hits_total"],
    # Who used the cores: the serving process (pdserve's frontend and Ray driver, or
    # vLLM's API server), the workers, Ray's own processes.
    "frontend CPU (s)": ["process_cpu_seconds_total"],
    "workers CPU (s)": ["pdserve_worker_cpu_seconds_total"],
    "Ray CPU (s)": ["pdserve_ray_cpu_seconds_total"],
}
CPU_FIGURES = ("frontend CPU (s)", "workers CPU (s)", "Ray CPU (s)")


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """Flat {series: value} of one `/metrics` page, or None when the server has none."""
    try:
        async with session.get(f"{url}/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    try:
        return parse_metrics(text)
    except ValueError:
        return None


def parse_metrics(text: str) -> dict[str, float]:
    """Counters, gauges and histogram sums/counts, keyed `name{label="v",...}`."""
    flat: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            key = sample.name + (_labels(sample.labels) if sample.labels else "")
            flat[("gauge:" if family.type == "gauge" else "") + key] = float(sample.value)
    return flat


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def delta(before: dict | None, after: dict | None) -> dict | None:
    """after - before for counters and histograms; gauges as they were at the end."""
    if before is None or after is None:
        return None
    out = {}
    for key, value in after.items():
        out[key] = value if key.startswith("gauge:") else value - before.get(key, 0.0)
    return out


def _series_total(metrics: dict, selector: str, suffix: str = "") -> float | None:
    """Sum over all series of `name{labels...}` that carry the selector's labels."""
    name, _, wanted = selector.partition("{")
    wanted_labels = [part for part in wanted.rstrip("}").split(",") if part]
    total, found = 0.0, False
    for key, value in metrics.items():
        base, _, labels = key.partition("{")
        if base == name + suffix and all(label in labels for label in wanted_labels):
            total, found = total + value, True
    return total if found else None


def worker_cpu_s(metrics_delta: dict | None) -> dict[str, float]:
    """Worker id -> CPU seconds it used over the run (workers that lived through it)."""
    figures = {}
    for key, value in (metrics_delta or {}).items():
        base, _, labels = key.partition("{")
        found = re.search(r'worker="([^"]*)"', labels)
        if base == "pdserve_worker_cpu_seconds_total" and found and value >= 0:
            figures[found.group(1)] = value
    return figures


def digest(metrics_delta: dict | None) -> dict[str, float]:
    """The comparable figures of one run's delta (missing ones are left out)."""
    if not metrics_delta:
        return {}
    figures: dict[str, float] = {}
    for label, selectors in _MEANS.items():
        for selector in selectors:
            total = _series_total(metrics_delta, selector, "_sum")
            count = _series_total(metrics_delta, selector, "_count")
            if total is not None and count:
                figures[label] = total / count
                break
    for label, selectors in _COUNTERS.items():
        values = [_series_total(metrics_delta, s) for s in selectors]
        values = [v for v in values if v is not None]
        if values:
            figures[label] = sum(values) if label == "requests failed" else values[0]
    return figures
