"""`pdserve drill` against a live server: real kills, and the JSON report proves nothing was lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.server_process import ServerProcess

pytestmark = pytest.mark.slow


def test_drill_kills_workers_and_reports_no_loss(tiny_llama_dir, tmp_path):
    server = ServerProcess(
        [
            "--model",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--transport",
            "shm",
            "--prefill-workers",
            "2",
            "--decode-workers",
            "2",
            "--block-size",
            "8",
        ]
    )
    report_path = tmp_path / "drill.json"
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "drill",
                "--url",
                server.url,
                "--kill",
                "random",
                "--count",
                "2",
                "--every",
                "1.0",
                "--requests",
                "24",
                "--concurrency",
                "8",
                "--max-tokens",
                "80",
                "--json",
                str(report_path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        leftovers = server.stop()
    assert result.returncode == 0, result.stdout + result.stderr + server.output()
    report = json.loads(report_path.read_text())
    assert report["passed"] is True
    # 24 requests, plus rounds of 8 when they finish before the second kill lands.
    assert report["requests"] >= 24
    assert report["requests"] == report["completed"] == report["exact"]
    assert report["failed"] == report["duplicated_text"] == report["missing_text"] == 0
    assert len(report["kills"]) == report["kills_planned"] == report["kills_hit"] == 2
    assert all(kill["held_requests"] > 0 for kill in report["kills"])  # no idle victim
    assert report["recovered"] > 0
    assert report["detect_max_s"] is not None and report["detect_max_s"] < 5.0
    assert report["full_strength_after_s"] is not None
    assert sum(report["recovery_paths"].values()) > 0
    assert report["leaked_blocks"] and not any(report["leaked_blocks"].values())
    assert "PASS" in result.stdout
    assert not leftovers


def test_a_short_soak_with_four_kills_loses_nothing(tiny_llama_dir, tmp_path):
    """The CI-sized soak: 2 minutes of steady load, a kill of either role every 25 s."""
    server = ServerProcess(
        [
            "--model", str(tiny_llama_dir), "--dtype", "float32", "--transport", "shm",
            "--prefill-workers", "2", "--decode-workers", "2", "--block-size", "8",
        ],
        env={"PDSERVE_STEP_DELAY_S": "0.01"},
    )  # fmt: skip
    report_path, plot_path = tmp_path / "soak.json", tmp_path / "soak.png"
    try:
        result = subprocess.run(
            [
                sys.executable, "-m", "cluster.cli", "drill", "--url", server.url,
                "--kill", "random", "--duration", "2m", "--every", "25", "--rate", "4",
                "--concurrency", "8", "--max-tokens", "48", "--json", str(report_path),
                "--plot", str(plot_path),
            ],
            capture_output=True, text=True, timeout=420,
        )  # fmt: skip
    finally:
        leftovers = server.stop()
    assert result.returncode == 0, result.stdout + result.stderr + server.output()
    report = json.loads(report_path.read_text())
    assert report["kills_planned"] == report["kills_hit"] == 4
    assert report["failed"] == report["duplicated_text"] == report["missing_text"] == 0
    assert report["requests"] == report["exact"] > 400
    soak = report["soak"]
    assert soak["throughput_back"] and soak["rss_flat"], soak
    assert plot_path.stat().st_size > 10_000
    assert not leftovers
