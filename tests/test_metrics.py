"""Metrics of a live `pdserve serve`: exact counts after known requests, promtool, a real
Prometheus scraping it, and the Grafana dashboard's queries against the exposition.

promtool and prometheus come from Debian's `prometheus` package (`make tools` unpacks
it into .tools/); tests needing them skip, saying so, only where neither copy exists.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import ServerProcess
from cluster.control.metrics import ClusterMetrics
from cluster.timeline import RequestTimeline
from engine.block_manager import blocks_needed
from worker.messages import HealthReport

ROOT = Path(__file__).resolve().parents[1]
TOOLS_BIN = ROOT / ".tools" / "prometheus" / "usr" / "bin"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pdserve.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
BLOCK_SIZE = 8
CANCELLED_MAX_TOKENS = 400


def tool(name: str) -> str:
    found = shutil.which(name) or (str(TOOLS_BIN / name) if (TOOLS_BIN / name).is_file() else None)
    if found is None:
        pytest.skip(f"{name} not in PATH nor in {TOOLS_BIN}; run `make tools` (CI does)")
    return found


# --- reading an exposition -----------------------------------------------------------


def parse(text: str) -> list:
    return list(text_string_to_metric_families(text))


def value(text: str, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        s.value
        for family in parse(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def sample_names(text: str) -> set[str]:
    """Every name a query can use: families without samples count with their suffixes."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    names = set()
    for family in parse(text):
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
        names.update(s.name for s in family.samples)
    return names


# --- unit: what a live tiny cluster does not exercise ---------------------------------


def test_failed_transfer_is_counted_by_reason_and_link():
    metrics = ClusterMetrics()
    timeline = RequestTimeline(
        "r1",
        arrival=1.0,
        prefill_worker="prefill-0",
        decode_worker="decode-1",
        transport="grpc",
        transfer_ok=False,
        transfer_failure="checksum",
        recomputed=True,
        recoveries=["transfer_failed"],
    )
    metrics.observe_timeline(timeline)
    text = metrics.render().decode()
    assert (
        value(
            text,
            "pdserve_kv_transfer_failures_total",
            transport="grpc",
            src="prefill-0",
            dst="decode-1",
            reason="checksum",
        )
        == 1
    )
    assert value(text, "pdserve_request_recoveries_total", kind="transfer_failed") == 1
    recomputes = "pdserve_kv_recomputes_total"
    assert value(text, recomputes, src="prefill-0", dst="decode-1", reason="checksum") == 1
    assert value(text, "pdserve_kv_transfer_bytes_total") == 0
    assert value(text, "pdserve_time_to_first_token_seconds_count") == 0  # no token came


def test_gpu_series_absent_without_nvml_and_present_with_a_report():
    worker = SimpleNamespace(
        worker_id="decode-0", role="decode", alive=True, standby=False, restarts=2, load=None
    )
    controller = SimpleNamespace(
        workers={"decode-0": worker},
        config=SimpleNamespace(transport=SimpleNamespace(name="auto")),
        prestarted=SimpleNamespace(counts=lambda: {"decode": 1}),
        worker_pids=lambda: {1},
    )
    metrics = ClusterMetrics(controller)
    worker.load = HealthReport(
        "decode-0",
        "decode",
        queue_depth=0,
        free_blocks=8,
        total_blocks=8,
        num_running=0,
        num_waiting=0,
        num_threads=1,
        pid=1,
    )
    text = metrics.render().decode()
    assert "pdserve_gpu_memory_used_bytes{" not in text
    assert "# TYPE pdserve_gpu_memory_used_bytes gauge" in text
    gpu = {"utilization_ratio": 0.5, "memory_used_bytes": 3, "memory_total_bytes": 9}
    worker.load = dataclasses.replace(worker.load, gpu=gpu, cpu_s=2.5)
    text = metrics.render().decode()
    assert value(text, "pdserve_worker_cpu_seconds_total", worker="decode-0") == 2.5
    assert value(text, "pdserve_gpu_memory_total_bytes", worker="decode-0") == 9
    assert value(text, "pdserve_worker_restarts_total", worker="decode-0") == 2
    assert value(text, "pdserve_workers_prestarted", role="decode") == 1


# --- a live server and a known set of requests --------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--transport", "shm"]
    args += ["--block-size", str(BLOCK_SIZE), "--max-model-len", "512", "--max-in-flight", "1"]
    process = ServerProcess(args)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def block_nbytes(tiny_llama_dir) -> int:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim
    return per_token * BLOCK_SIZE * 4  # float32


@pytest.fixture(scope="module")
def scenario(server, tiny_llama_dir, block_nbytes):
    """Runs the requests once; returns what the metrics must say, then waits until they do."""
    model = tiny_llama_dir.name
    url = server.url
    produced = []  # (prompt_tokens, completion_tokens) of requests that finished
    # 1. Non-streaming completion, prompt given as token ids.
    body = completion_body(model, list(range(2, 14)), max_tokens=5)
    produced.append(usage_of(post(url, "/v1/completions", body)))
    # 2. Non-streaming chat.
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}]}
    body.update(max_tokens=4, ignore_eos=True, temperature=0)
    produced.append(usage_of(post(url, "/v1/chat/completions", body)))
    # 3. Streaming completion with a usage chunk at the end.
    body = completion_body(model, list(range(3, 23)), max_tokens=6, stream=True)
    body["stream_options"] = {"include_usage": True}
    produced.append(streamed_usage(url, body))
    # 4. A bad request (context exceeded): 400, counted as error.
    body = completion_body(model, [5, 6, 7], max_tokens=100_000)
    assert requests.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 400
    # 5. A long stream, cancelled by the client after three chunks; while it holds the one
    #    admission slot, a chat request is turned away with 429 (rejected).
    cancelled_prompt = list(range(4, 13))
    seen = cancel_mid_stream(url, model, cancelled_prompt)
    expected_bytes = sum(
        blocks_needed(prompt, BLOCK_SIZE) * block_nbytes
        for prompt, _ in [*produced, (len(cancelled_prompt), None)]
    )
    expected = SimpleNamespace(
        finished=produced,
        cancelled_prompt=len(cancelled_prompt),
        cancelled_seen=seen,
        kv_bytes=expected_bytes,
    )
    text = wait_until_settled(url, with_tokens=4)
    return expected, text


def completion_body(model, prompt_ids, max_tokens, stream=False) -> dict:
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def post(url: str, path: str, body: dict) -> dict:
    response = requests.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def usage_of(response: dict) -> tuple[int, int]:
    return response["usage"]["prompt_tokens"], response["usage"]["completion_tokens"]


def sse_events(response):
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[len(b"data: ") :])


def streamed_usage(url: str, body: dict) -> tuple[int, int]:
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200
        usage = [e["usage"] for e in sse_events(response) if e.get("usage")][-1]
    return usage["prompt_tokens"], usage["completion_tokens"]


def cancel_mid_stream(url: str, model: str, prompt_ids: list[int]) -> int:
    """Returns how many tokens the client saw before it went away."""
    body = completion_body(model, prompt_ids, max_tokens=CANCELLED_MAX_TOKENS, stream=True)
    body["stream_options"] = {"continuous_usage_stats": True}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as response:
        events = sse_events(response)
        # Chunks after the first come from the decode worker: the KV has moved.
        seen = [next(events) for _ in range(3)][-1]["usage"]["completion_tokens"]
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        busy = requests.post(f"{url}/v1/chat/completions", json=chat, timeout=30)
        assert busy.status_code == 429, busy.text
    return seen


def wait_until_settled(url: str, with_tokens: int, timeout_s: float = 20.0) -> str:
    """Metrics once every stream ended, every block and lease is back, and the
    workers' next health report (batch sizes) covers all prefills."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = requests.get(f"{url}/metrics", timeout=10).text
        settled = (
            value(text, "pdserve_requests_total", outcome="cancelled") == 1
            and value(text, "pdserve_time_to_first_token_seconds_count") == with_tokens
            and value(text, "pdserve_kv_blocks_used") == 0
            and value(text, "pdserve_kv_leases_outstanding") == 0
            and value(text, "pdserve_prefill_batch_size_sum", role="prefill") == with_tokens
        )
        if settled:
            return text
        assert time.monotonic() < deadline, f"metrics did not settle:\n{text}"
        time.sleep(0.25)


def test_counters_and_histograms_match_the_requests(scenario):
    expected, text = scenario
    outcomes = {
        ("ok", "completions"): 2,
        ("ok", "chat"): 1,
        ("error", "completions"): 1,
        ("rejected", "chat"): 1,
        ("cancelled", "completions"): 1,
    }
    for outcome in ("ok", "error", "rejected", "timeout", "cancelled"):
        for endpoint in ("completions", "chat"):
            got = value(text, "pdserve_requests_total", outcome=outcome, endpoint=endpoint)
            assert got == outcomes.get((outcome, endpoint), 0), (outcome, endpoint)

    with_tokens, finished = 4, len(expected.finished)
    assert value(text, "pdserve_time_to_first_token_seconds_count") == with_tokens
    assert value(text, "pdserve_e2e_request_latency_seconds_count") == finished
    assert value(text, "pdserve_time_per_output_token_seconds_count") == finished

    prompt = sum(p for p, _ in expected.finished) + expected.cancelled_prompt
    assert value(text, "pdserve_prompt_tokens_total") == prompt
    generated = value(text, "pdserve_generation_tokens_total")
    cancelled_generated = generated - sum(c for _, c in expected.finished)
    # The cancelled stream's tokens count too: the server made at least what the client
    # saw, and never more than it asked for.
    assert expected.cancelled_seen <= cancelled_generated <= CANCELLED_MAX_TOKENS
    assert value(text, "pdserve_inter_token_latency_seconds_count") == generated - with_tokens

    for phase, worker, count in [
        ("prefill_queue", "prefill-0", with_tokens),
        ("prefill", "prefill-0", with_tokens),
        ("decode_queue", "decode-0", with_tokens),
        ("kv_transfer", "decode-0", with_tokens),
        ("decode", "decode-0", finished),
    ]:
        got = value(text, "pdserve_phase_seconds_count", phase=phase, worker=worker)
        assert got == count, phase

    link = {"transport": "shm", "src": "prefill-0", "dst": "decode-0"}
    assert value(text, "pdserve_kv_transfer_bytes_total", **link) == expected.kv_bytes
    assert value(text, "pdserve_kv_transfer_bytes_total") == expected.kv_bytes
    assert value(text, "pdserve_kv_transfers_total", **link) == with_tokens
    assert value(text, "pdserve_kv_transfer_seconds_count", **link) == with_tokens
    assert value(text, "pdserve_kv_transfer_failures_total") == 0
    assert value(text, "pdserve_kv_transport_configured_info", transport="shm") == 1

    assert value(text, "pdserve_workers_alive", role="prefill") == 1
    assert value(text, "pdserve_workers_alive", role="decode") == 1
    assert value(text, "pdserve_worker_restarts_total") == 0
    assert value(text, "pdserve_kv_blocks_capacity", worker="decode-0") > 0
    assert value(text, "pdserve_requests_running") == 0
    assert value(text, "pdserve_requests_waiting") == 0
    # One short prompt per prefill step here; the decode worker only decodes.
    assert value(text, "pdserve_prefill_batch_size_count", worker="prefill-0") == with_tokens
    assert value(text, "pdserve_prefill_batch_size_count", worker="decode-0") == 0
    decoded = sum(c - 1 for _, c in expected.finished) + expected.cancelled_seen - 1
    assert value(text, "pdserve_decode_batch_size_sum", worker="decode-0") >= decoded
    assert value(text, "pdserve_gpu_utilization_ratio") == 0  # CPU workers: no GPU series
    # Who used the cores: this process, each worker, Ray's own processes (its head here).
    assert value(text, "process_cpu_seconds_total") > 0
    for worker in ("prefill-0", "decode-0"):
        assert value(text, "pdserve_worker_cpu_seconds_total", worker=worker) > 0
    assert value(text, "pdserve_ray_cpu_seconds_total") > 0


def test_promtool_accepts_the_exposition(server, scenario):
    promtool = tool("promtool")
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_exported_metrics(server, scenario):
    exported = sample_names(requests.get(f"{server.url}/metrics", timeout=10).text)
    queries = dashboard_queries()
    assert queries
    for expr in queries:
        names = set(re.findall(r"\bpdserve_[A-Za-z0-9_]+", expr))
        assert names, f"query names no pdserve metric: {expr}"
        assert names <= exported, f"not exported: {names - exported} in {expr}"


def test_real_prometheus_scrapes_the_server(server, scenario, tmp_path):
    expected, _ = scenario
    binary = tool("prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{server.port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log_path = tmp_path / "prometheus.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            "--web.listen-address=127.0.0.1:0",  # it binds a free port and logs it
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        api = f"http://{prometheus_address(log_path, proc)}/api/v1/query"
        count = wait_for_query(api, "sum(pdserve_time_to_first_token_seconds_count)", proc)
        assert float(count[0]["value"][1]) == 4
        moved = wait_for_query(api, "sum(pdserve_kv_transfer_bytes_total)", proc)
        assert float(moved[0]["value"][1]) == expected.kv_bytes
        buckets = query(api, "pdserve_time_to_first_token_seconds_bucket")
        assert {b["metric"]["le"] for b in buckets} >= {"0.1", "1.0", "+Inf"}
        for expr in dashboard_queries():  # the dashboard's PromQL parses and evaluates
            query(api, expr.replace("$__rate_interval", "1m"))
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def prometheus_address(log_path: Path, proc, timeout_s: float = 20.0) -> str:
    """The address Prometheus logged once it listened ("Listening on" address=...)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited: {log_path.read_text()[-2000:]}"
        found = re.search(r'msg="Listening on" address=(\S+)', log_path.read_text())
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise AssertionError(f"prometheus never listened: {log_path.read_text()[-2000:]}")


def query(api: str, expr: str) -> list:
    answer = requests.get(api, params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def wait_for_query(api: str, expr: str, proc, timeout_s: float = 20.0) -> list:
    """The first non-empty answer (Prometheus needs a moment to start and scrape)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prometheus exited"
        try:
            result = query(api, expr)
            if result:
                return result
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise AssertionError(f"prometheus returned nothing for {expr} in {timeout_s}s")
