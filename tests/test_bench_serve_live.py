"""`pdserve bench serve` against a live `pdserve serve` (tiny model): the client's counts
match the server's own /metrics over the measured interval, warm-up excluded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    process = ServerProcess(
        [
            "--model",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--transport",
            "shm",
            "--block-size",
            "8",
            "--max-model-len",
            "512",
        ]
    )
    yield process
    leftovers = process.stop()
    assert not leftovers, f"processes left after SIGTERM: {[p.pid for p in leftovers]}"


def _bench(server, tiny_llama_dir, tmp_path, *flags) -> dict:
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "cluster.cli",
        "bench",
        "serve",
        "--url",
        server.url,
        "--tokenizer",
        str(tiny_llama_dir),
        "--no-progress",
        "--json",
        str(report),
        "--csv",
        str(tmp_path / "report.csv"),
        *flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr + server.output()
    assert "Definitions:" in result.stdout and "INCLUDES PROMPT TOKENS" in result.stdout
    return json.loads(report.read_text())


def test_counts_match_the_servers_own_metrics(server, tiny_llama_dir, tmp_path):
    report = _bench(
        server,
        tiny_llama_dir,
        tmp_path,
        *("--concurrency", "4", "--num-prompts", "12", "--warmup", "3"),
        *("--prompt-len", "24-40", "--output-len", "6", "--slo", "ttft_ms=60000"),
    )

    (point,) = report["points"]
    run = point["runs"][0]
    summary, digest = run["summary"], run["server_metrics"]["digest"]
    assert summary["requests"] == summary["ok"] == 12 and len(run["records"]) == 12
    assert len(run["warmup_records"]) == 3
    assert digest["requests ok"] == 12  # the warm-up came before the first scrape
    assert digest["generated tokens"] == summary["output_tokens"] == 12 * 6
    assert digest["prompt tokens"] == summary["prompt_tokens"]
    # The client's exact counts are the server's.
    assert all(r["prompt_tokens"] == r["server_prompt_tokens"] for r in run["records"])
    assert all(24 <= r["prompt_tokens"] <= 40 for r in run["records"])
    assert summary["server_ttft_mean_s"] is not None and summary["goodput_share"] == 1.0
    assert report["header"]["machine"]["cpu_model"]
    csv_rows = (tmp_path / "report.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + 12


def test_multi_turn_chat_resends_the_history(server, tiny_llama_dir, tmp_path):
    report = _bench(
        server,
        tiny_llama_dir,
        tmp_path,
        *("--endpoint", "chat", "--workload", "multi-turn", "--turns", "3"),
        *("--concurrency", "2", "--num-prompts", "2", "--warmup", "0"),
        *("--prompt-len", "12", "--output-len", "5"),
    )

    records = report["points"][0]["runs"][0]["records"]
    assert len(records) == 6 and all(r["outcome"] == "ok" for r in records)
    for session in (0, 1):
        turns = sorted((r for r in records if r["session"] == session), key=lambda r: r["turn"])
        lengths = [r["server_prompt_tokens"] for r in turns]
        assert lengths[0] == turns[0]["prompt_tokens"]
        assert lengths[0] < lengths[1] < lengths[2]  # each turn carries the replies before it
