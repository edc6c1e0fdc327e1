"""`pdserve bench transfer` end to end on a small size: every column measured, every
transport moved the bytes itself (no silent fallback), JSON written."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_transfer_measures_every_transport_and_ceiling(tmp_path):
    out = tmp_path / "transfer.json"
    command = [sys.executable, "-m", "cluster.cli", "bench", "transfer"]
    command += ["--sizes", "2MiB", "--repeats", "1", "--chunk", "1MiB", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["transports_used"] == {
        "shm": ["shm"],
        "collective": ["collective"],
        "grpc": ["grpc"],
    }
    (row,) = report["results"]
    columns = ("memcpy", "pool-memcpy", "gloo-paired", "grpc-paired", "socket")
    columns += ("gloo-bare", "grpc-bare")
    for column in (*columns, "shm", "collective", "grpc"):
        assert row[column] > 0, column
    assert "against the bare library" in result.stdout
    assert "shm/pool-memcpy, collective/gloo-paired, grpc/grpc-paired" in result.stdout
    assert set(report["paired_median_ratios"]) == {"shm", "collective", "grpc"}
    assert all(r["2097152"] > 0 for r in report["paired_median_ratios"].values())
