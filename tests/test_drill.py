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
    assert len(report["kills"]) == report["kills_planned"] == 2
    assert report["full_strength_after_s"] is not None
    assert report["leaked_blocks"] and not any(report["leaked_blocks"].values())
    assert "PASS" in result.stdout
    assert not leftovers
