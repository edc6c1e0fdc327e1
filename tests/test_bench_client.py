"""`pdserve bench serve` and friends: arithmetic on known inputs, arrivals, workloads, and
runs against a real loopback HTTP server that fails some requests on purpose."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from bench.arrivals import ArrivalSpec, inter_arrival_gaps
from bench.compare import format_comparison
from bench.lengths import LengthSpec
from bench.loadgen import RequestRecord
from bench.prompt_text import PromptMaker
from bench.report import point_entry, server_cpu_line, write_json
from bench.runner import RunSpec, run_once
from bench.server_metrics import digest
from bench.stats import percentile, spread
from bench.summary import Slo, summarize
from bench.sweep import pareto_front, plot_sweep
from bench.workloads import WorkloadSpec, build_sessions

# --- arithmetic ---------------------------------------------------------------------------


def test_percentiles_interpolate_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile([], 50) is None
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    samples = [random.Random(3).expovariate(1.0) for _ in range(257)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(samples, q) == pytest.approx(np.percentile(samples, q))
    assert spread([3, None, 1, 2]) == {"min": 1, "median": 2, "max": 3}


def _record(index, ttft, tokens, e2e, outcome="ok", status=200, prompt=10):
    """A finished request: first token at `ttft`, `tokens` chunks evenly spaced up to `e2e`."""
    record = RequestRecord(index, outcome=outcome, ok=outcome == "ok", status=status)
    record.start, record.end = 100.0, 100.0 + e2e
    record.prompt_tokens, record.completion_tokens = prompt, tokens if outcome == "ok" else 0
    if outcome == "ok":
        record.first_token = 100.0 + ttft
        step = (e2e - ttft) / (tokens - 1)
        record.chunk_times = [record.first_token + i * step for i in range(tokens)]
    return record


def test_goodput_and_summary_keep_failures_in_every_denominator():
    records = [
        _record(0, ttft=0.2, tokens=11, e2e=1.2),  # TPOT 100 ms: good
        _record(1, ttft=0.4, tokens=11, e2e=1.4),  # TPOT 100 ms, TTFT over the bound
        _record(2, ttft=0.1, tokens=11, e2e=3.1),  # TPOT 300 ms: over the bound
        _record(3, ttft=0.1, tokens=5, e2e=0.5),  # TPOT 100 ms: good
        _record(4, 0, 0, 0.05, outcome="error", status=503),
        _record(5, 0, 0, 30.0, outcome="timeout", status=200),
    ]
    slo = Slo.parse("ttft_ms=300,tpot_ms=150")
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s) == (0.3, 0.15, None)

    s = summarize(records, duration_s=10.0, slo=slo)

    assert (s["requests"], s["ok"], s["error"], s["timeout"], s["failed"]) == (6, 4, 1, 1, 2)
    assert s["errors_by_status"] == {"503": 1}
    assert s["good_requests"] == 2
    assert s["goodput_req_s"] == pytest.approx(0.2)
    assert s["goodput_share"] == pytest.approx(2 / 6)  # failures count against it
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_tokens"] == 38 and s["output_throughput"] == pytest.approx(3.8)
    assert s["total_token_throughput"] == pytest.approx((38 + 40) / 10)  # includes prompts
    assert s["tpot_mean_s"] == pytest.approx((0.1 + 0.1 + 0.3 + 0.1) / 4)
    assert s["ttft_p50_s"] == pytest.approx(0.15)
    assert s["e2e_p50_s"] == pytest.approx(1.3)
    assert s["itl_p50_s"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        Slo.parse("latency=3")


def test_repeats_report_min_median_max():
    runs = [{"summary": {"ttft_p50_s": v, "ok": 8, "slo": "x"}} for v in (0.3, 0.1, 0.2)]
    point = point_entry("concurrency=4", {"concurrency": 4}, runs)
    assert point["repeats"]["ttft_p50_s"] == {"min": 0.1, "median": 0.2, "max": 0.3}
    assert point["summary"]["ttft_p50_s"] == 0.2


# --- arrivals and lengths -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "burstiness", "cv"),
    [("constant", 1.0, 0.0), ("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)],
)
def test_arrivals_produce_the_asked_rate(kind, burstiness, cv):
    gaps = inter_arrival_gaps(ArrivalSpec(rate=8.0, kind=kind, burstiness=burstiness), 6001, 11)
    assert gaps[0] == 0.0
    gaps = gaps[1:]
    mean = statistics.fmean(gaps)
    # 6000 gaps: the mean's standard error is cv / sqrt(6000) of itself (2.6% for cv 2).
    assert 1 / mean == pytest.approx(8.0, rel=max(0.01, 4 * cv / 6000**0.5))
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, abs=0.1)


def test_closed_loop_has_no_gaps_and_specs_are_validated():
    assert inter_arrival_gaps(ArrivalSpec(concurrency=4), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        ArrivalSpec()
    with pytest.raises(ValueError):
        ArrivalSpec(rate=1.0, kind="uniform")


def test_length_specs():
    rng = random.Random(0)
    assert LengthSpec.parse("64").sample(rng) == 64
    uniform = [LengthSpec.parse("10-20").sample(rng) for _ in range(500)]
    assert min(uniform) == 10 and max(uniform) == 20
    normal = [LengthSpec.parse("normal:100,10").sample(rng) for _ in range(2000)]
    assert statistics.fmean(normal) == pytest.approx(100, abs=1.5)
    for bad in ("abc", "20-10", "0"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)


# --- workloads ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def maker(tiny_llama_dir):
    return PromptMaker.from_arg(str(tiny_llama_dir))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_random_prompts_have_exact_token_counts(maker, endpoint):
    spec = WorkloadSpec(endpoint=endpoint, prompt_len="30-90", output_len="8")
    for session in build_sessions(spec, maker, 12, seed=1):
        turn = session.turns[0]
        if endpoint == "chat":
            assert maker.count_chat(list(turn.messages)) == turn.prompt_tokens
        else:
            assert maker.count_completion(turn.content) == turn.prompt_tokens
        assert 30 <= turn.prompt_tokens <= 90 and turn.output_len == 8


def test_shared_prefix_groups_share_their_system_prompt(maker):
    spec = WorkloadSpec(kind="shared-prefix", num_groups=3, prefix_len=40, question_len=12)
    sessions = build_sessions(spec, maker, 9, seed=0)
    assert [s.group for s in sessions] == [0, 1, 2] * 3
    prompts = [s.turns[0].content for s in sessions]
    for group in range(3):
        members = prompts[group::3]
        prefix = members[0][: len(members[0]) // 2]
        assert all(p.startswith(prefix) for p in members) and len(set(members)) == 3
    assert all(s.turns[0].prompt_tokens == 52 for s in sessions)


def test_datasets_jsonl_and_sharegpt(maker, tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "the quick brown fox", "output_len": 5},
        {"messages": [{"role": "user", "content": "the lazy dog"}]},
    ]
    jsonl.write_text("\n".join(json.dumps(line) for line in lines))
    spec = WorkloadSpec(kind="jsonl", dataset=str(jsonl), endpoint="chat")
    turns = [s.turns[0] for s in build_sessions(spec, maker, 4, seed=0)]
    assert sorted(t.output_len for t in turns[:2]) == [5, 64]
    assert all(t.messages[-1]["role"] == "user" for t in turns)

    sharegpt = tmp_path / "sharegpt.json"
    conversation = [{"from": "human", "value": "the fox"}, {"from": "gpt", "value": "the dog"}]
    sharegpt.write_text(json.dumps([{"id": "a", "conversations": conversation}]))
    spec = WorkloadSpec(kind="sharegpt", dataset=str(sharegpt))
    (turn,) = build_sessions(spec, maker, 1, seed=0)[0].turns
    assert turn.content == "the fox"
    assert turn.output_len == len(maker.hf.encode("the dog", add_special_tokens=False))


# --- against a real loopback HTTP server ----------------------------------------------------


class FakeOpenAI:
    """An aiohttp OpenAI-style server that misbehaves on prompts carrying a marker."""

    def __init__(self):
        self.seen: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, _request):
        body = f"# TYPE fake_requests_total counter\nfake_requests_total {len(self.seen)}\n"
        return web.Response(text=body, content_type="text/plain")

    async def completions(self, request):
        body = await request.json()
        prompt = body["prompt"]
        self.seen.append(prompt)
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        if "SLOW" in prompt:
            await asyncio.sleep(1.5)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        tokens = body["max_tokens"] if "CUT" not in prompt else 2
        for _ in range(tokens):
            chunk = {"choices": [{"index": 0, "text": " the", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if "ERROREVENT" in prompt:
            await response.write(b'data: {"error": {"message": "worker died"}}\n\n')
        if "NOUSAGE" in prompt:
            await response.write(b"data: [DONE]\n\n")
        elif "CUT" not in prompt:
            usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens}}
            await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response


@pytest.fixture
def fake_server():
    """Runs the fake on a free loopback port inside the test's own event loop."""

    async def start(fake: FakeOpenAI):
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return runner, f"http://127.0.0.1:{port}"

    return start


def _run_against(fake_server, spec_changes: dict, maker):
    fake = FakeOpenAI()

    async def scenario():
        runner, url = await fake_server(fake)
        try:
            spec = RunSpec(url=url, model="m", progress=False, **spec_changes)
            return await run_once(spec, maker)
        finally:
            await runner.cleanup()

    return fake, asyncio.run(scenario())


def test_failed_requests_are_counted_as_failed(fake_server, maker, tmp_path):
    prompts = ["fine one", "FAIL please", "CUT short", "ERROREVENT now", "SLOW down", "NOUSAGE"]
    dataset = tmp_path / "p.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p, "output_len": 4}) for p in prompts))
    workload = WorkloadSpec(kind="jsonl", dataset=str(dataset))
    changes = dict(workload=workload, arrival=ArrivalSpec(concurrency=3), num_prompts=6)

    _, result = _run_against(fake_server, {**changes, "warmup": 0, "timeout_s": 0.5}, maker)

    by_prompt = {r.index: r for r in result.records}
    outcomes = sorted(r.outcome for r in by_prompt.values())
    assert outcomes == ["error", "error", "error", "ok", "ok", "timeout"]
    s = result.summary
    assert (s["requests"], s["ok"], s["failed"], s["error"], s["timeout"]) == (6, 2, 4, 3, 1)
    assert s["errors_by_status"] == {"500": 1}
    # Usage of the one good request that sent it; the other's 4 tokens counted from its text.
    assert s["output_tokens"] == 8 and s["prompt_tokens"] == 7 + _client_count_without_usage(result)
    assert result.server_metrics["delta"] == {"fake_requests_total": 6.0}


def _client_count_without_usage(result) -> int:
    """The client's own count for the request whose server sent no usage."""
    (record,) = [r for r in result.records if r.ok and r.server_prompt_tokens is None]
    return record.prompt_tokens


def test_warmup_requests_are_absent_from_the_results(fake_server, maker):
    workload = WorkloadSpec(prompt_len="20", output_len="3")
    changes = dict(workload=workload, arrival=ArrivalSpec(concurrency=2), num_prompts=5)

    fake, result = _run_against(fake_server, {**changes, "warmup": 3}, maker)

    assert len(fake.seen) == 8
    warmup_prompts, measured_prompts = set(fake.seen[:3]), set(fake.seen[3:])
    assert not warmup_prompts & measured_prompts  # distinct prompts, not a rerun
    assert len(result.warmup_records) == 3 and len(result.records) == 5
    assert result.summary["requests"] == 5 and result.summary["ok"] == 5
    assert all(r.ok and r.completion_tokens == 3 for r in result.records)


def test_open_loop_with_a_cap_records_client_queueing(fake_server, maker):
    workload = WorkloadSpec(prompt_len="8", output_len="2")
    arrival = ArrivalSpec(rate=200.0, concurrency=1, kind="constant")
    changes = dict(workload=workload, arrival=arrival, num_prompts=6, warmup=0)

    _, result = _run_against(fake_server, changes, maker)

    assert result.summary["ok"] == 6
    assert all(r.scheduled is not None and r.queued_s >= 0 for r in result.records)
    starts = sorted(r.start for r in result.records)
    assert starts[-1] - starts[0] >= 5 / 200 * 0.9  # constant gaps were honoured


# --- reports: sweep plots and comparisons ----------------------------------------------------


def _point(label, variable, throughput, ttft, digest=None):
    summary = {
        "ok": 8,
        "requests": 8,
        "failed": 0,
        "request_throughput": throughput / 64,
        "output_throughput": throughput,
        "ttft_p50_s": ttft,
        "ttft_p99_s": ttft * 2,
        "itl_p50_s": 0.05,
        "itl_p99_s": 0.1,
        "tpot_mean_s": 0.05,
        "e2e_p50_s": 3.0,
    }
    runs = [{"summary": summary, "server_metrics": {"digest": digest} if digest else None}]
    return {"label": label, "variable": variable, "runs": runs, "summary": summary}


def test_sweep_writes_its_plots(tmp_path):
    points = [_point(f"concurrency={c}", {"concurrency": c}, 10 * c, 0.1 * c) for c in (1, 4, 16)]
    paths = plot_sweep(points, "concurrency", str(tmp_path / "sweep"))
    for path in paths:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pareto_front([(10, 1.0), (20, 0.5), (15, 2.0), (30, 3.0)]) == [(20, 0.5), (30, 3.0)]


def test_a_run_is_drawn_and_each_chunk_placed_at_its_arrival(tmp_path):
    """`bench serve --plot`: every point's requests, distributions and chunks per second;
    a chunk's time is the request's start + TTFT + the gaps before it."""
    from bench.serve_plot import plot_run, token_times

    def record(index: int, start: float, outcome: str = "ok") -> dict:
        ok = outcome == "ok"
        return {"index": index, "outcome": outcome, "start_s": start,
                "ttft_s": 0.5 if ok else None, "e2e_s": 1.1 if ok else 0.2,
                "itl_s": [0.2, 0.2, 0.2] if ok else []}  # fmt: skip

    assert token_times(record(0, 1.0)) == pytest.approx([1.5, 1.7, 1.9, 2.1])
    assert token_times(record(1, 1.0, "error")) == []
    runs = [{"records": [record(i, 0.3 * i, "error" if i == 3 else "ok") for i in range(8)]}]
    entries = [{"label": f"concurrency={c}", "runs": runs * 2} for c in (1, 4)]
    path = plot_run(entries, str(tmp_path / "run.png"))
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path(path).stat().st_size > 30_000


def test_compare_shows_ratios_and_what_moved_in_the_server(tmp_path):
    header = {"workload": {"kind": "random"}, "machine": {"cpu_model": "x"}}
    a = _point("concurrency=16", {}, 20.0, 2.0, {"decode batch size": 8.0, "prefill (s)": 1.0})
    b = _point("concurrency=16", {}, 30.0, 1.0, {"decode batch size": 12.0, "prefill (s)": 1.5})
    write_json(str(tmp_path / "a.json"), header, [a])
    write_json(str(tmp_path / "b.json"), header, [b])

    text = format_comparison(str(tmp_path / "a.json"), str(tmp_path / "b.json"))

    assert "output tok/s" in text and "1.50x" in text and "0.50x" in text
    assert "decode batch size" in text and "server (/metrics delta)" in text


def test_the_report_says_who_used_the_servers_cores():
    """The /metrics delta's CPU counters, as shares of one core over the run, with each
    worker's own share where there are several."""
    delta = {
        "process_cpu_seconds_total": 1.0,
        'pdserve_worker_cpu_seconds_total{role="prefill",worker="prefill-0"}': 30.0,
        'pdserve_worker_cpu_seconds_total{role="decode",worker="decode-0"}': 20.0,
        "pdserve_ray_cpu_seconds_total": 2.0,
    }
    run = {"summary": {"duration_s": 50.0}, "server_metrics": {"delta": delta}}
    run["server_metrics"]["digest"] = digest(delta)
    assert server_cpu_line(run) == (
        "server CPU over the run (share of one core): frontend 2.0%; workers 100.0%; "
        "Ray 4.0%; decode-0 40.0%, prefill-0 60.0%"
    )
    run["server_metrics"] = None  # a server without /metrics
    assert server_cpu_line(run) is None


def test_duration_mode_starts_nothing_after_the_deadline(fake_server, maker):
    workload = WorkloadSpec(prompt_len="8", output_len="2")
    arrival = ArrivalSpec(rate=50.0, kind="constant")
    changes = dict(workload=workload, arrival=arrival, num_prompts=None, duration_s=0.3)

    _, result = _run_against(fake_server, {**changes, "warmup": 0}, maker)

    starts = [r.start - result.started_at for r in result.records]
    assert 10 <= len(starts) <= 16  # 50/s for 0.3 s: 15 due before the deadline
    assert max(starts) < 0.3 and result.summary["ok"] == len(starts)
