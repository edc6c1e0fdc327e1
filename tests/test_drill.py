"""`pdserve drill` against a live server: real kills, and the JSON report proves nothing was lost."""

from __future__ import annotations

import argparse
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
                # Decode victims: the tiny model prefills in milliseconds, so a prefill
                # victim's prompt is often done by the time the signal lands, and the
                # drill rightly fails a kill that recovered nothing (recovered 0, a FAIL
                # at 23:46). Prefill kills are driven by tests/test_recovery.py, with
                # steps slowed down, and by the soak below.
                "--kill",
                "decode",
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
    affected = report["affected_requests"]
    assert len(affected) == report["recovered"]
    assert all(a["recoveries"] and a["server_timings"] for a in affected)
    assert all(abs(a["extra_s"] - (a["e2e_s"] - a["baseline_s"])) < 0.002 for a in affected)
    assert report["leaked_blocks"] and not any(report["leaked_blocks"].values())
    assert "PASS" in result.stdout
    assert not leftovers


@pytest.mark.soak
def test_a_short_soak_with_four_kills_loses_nothing(tiny_llama_dir, tmp_path):
    """The CI-sized soak: a minute of steady load, a kill of either role every 12 s."""
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
                "--kill", "random", "--duration", "60s", "--every", "12", "--rate", "4",
                "--concurrency", "8", "--max-tokens", "48", "--cold-cache",
                "--json", str(report_path), "--plot", str(plot_path),
            ],
            capture_output=True, text=True, timeout=420,
        )  # fmt: skip
    finally:
        leftovers = server.stop()
    wrong = json.loads(report_path.read_text())["wrong_requests"] if report_path.exists() else []
    assert result.returncode == 0, f"{result.stdout}{result.stderr}{wrong}{server.output()}"
    report = json.loads(report_path.read_text())
    assert report["kills_planned"] == report["kills_hit"] == 4
    assert report["failed"] == report["duplicated_text"] == report["missing_text"] == 0
    assert report["requests"] == report["exact"] > 200
    soak = report["soak"]
    assert soak["throughput_back"] and soak["rss_flat"] and soak["rss_judged"] >= 1, soak
    assert plot_path.stat().st_size > 10_000
    assert not leftovers


def test_soak_kills_are_jittered_off_the_load_period():
    """A kill every 30 s on an exact grid caught every request of a 0.5 req/s load in
    the same phase (its prefill) 59 times out of 59; jittered, the phases spread."""
    from bench.drill import kill_times

    args = argparse.Namespace(duration="30m", every=30.0, at=None, count=1)
    times = kill_times(args)
    assert times == kill_times(args)  # seeded: a soak can be rerun as it was
    assert len(times) == 59
    assert all(abs(t - 30 * (k + 1)) <= 7.5 for k, t in enumerate(times))
    assert len({round(t % 2.0, 1) for t in times}) > 8


def test_rss_is_judged_after_the_warm_up():
    """Private RSS that grows early, then stays, is flat; growth that goes on after the
    warm-up is a leak. A shared pool filling in page by page (RssShmem) is reported,
    not judged. Short-lived processes are not judged."""
    from bench.soak import _rss_growth

    mib = 1 << 20
    warming = [(t, (1000 + min(t, 60) * 10) * mib, 10 * t * mib) for t in range(0, 600, 2)]
    leaking = [(t, (1000 + t) * mib, 0) for t in range(0, 600, 2)]
    short = [(t, (1000 + 10 * t) * mib, 0) for t in range(0, 100, 2)]
    flat = _rss_growth({1: warming, 3: short}, warmup_s=120)
    assert flat["rss_flat"] and flat["rss_judged"] == 1 and flat["rss_warmup_growth_mib"] == 600
    assert flat["rss_shared_growth_mib"] == 5980
    leak = _rss_growth({2: leaking}, warmup_s=120)
    assert not leak["rss_flat"] and leak["rss_worst_growth_mib"] == 478


def test_shared_memory_is_told_apart_from_private_memory():
    """A shared anonymous mapping (how the KV pool is allocated) counts as shared."""
    import mmap
    import os

    from bench.soak import resident_memory

    private_before, shared_before = resident_memory(os.getpid())
    pages = mmap.mmap(-1, 64 << 20)
    for offset in range(0, len(pages), mmap.PAGESIZE):
        pages[offset] = 1
    private_after, shared_after = resident_memory(os.getpid())
    assert shared_after - shared_before >= 60 << 20
    assert private_after - private_before < 16 << 20
    pages.close()


def test_the_report_compares_resume_gaps_by_recovery_path():
    """Each affected stream's gap around the kill is kept, and the median per path
    compares the paths within one drill."""
    from bench.drill_report import KillEvent, verdict
    from bench.loadgen import RequestRecord

    def stream(index: int, times: list[float], path: str | None) -> RequestRecord:
        timings = {"recoveries": ["decode_died"], "recovery_paths": [path]} if path else {}
        return RequestRecord(
            index,
            prompt="p",
            ok=True,
            text="t",
            end=times[-1],
            chunk_times=times,
            server_timings=timings,
        )

    records = [
        stream(0, [1.0, 2.0, 2.5], "recompute"),  # gap 1.0 around the kill at 1.5
        stream(1, [1.4, 1.7, 1.8], "recompute"),  # 0.3
        stream(2, [1.2, 3.2, 3.3], "reprefill"),  # 2.0
        stream(3, [1.0, 1.1, 1.2], None),  # done before the kill: not affected
    ]
    kill = KillEvent(1.5, "decode-0", "decode", pid=1, held_requests=3, killed_at=1.5)
    reference = {"p": RequestRecord(9, prompt="p", ok=True, text="t", end=1.0)}
    report = verdict(records, reference, [kill], {}, {})
    assert [entry["resume_gaps_s"] for entry in report.affected_requests] == [[1.0], [0.3], [2.0]]
    assert report.resume_gap_by_path == {"recompute": 0.65, "reprefill": 2.0}


def test_extra_latency_is_against_the_same_place_in_the_uninterrupted_pass():
    """One prompt at two places in the load: each affected request is timed against the
    request at its own place in the pass with no kill (its place in the queues), not
    against the prompt's run in the reference pass."""
    from bench.drill_report import verdict
    from bench.loadgen import RequestRecord

    def run(index: int, e2e: float, affected: bool = False) -> RequestRecord:
        timings = {"recoveries": ["decode_died"], "recovery_paths": ["recompute"]}
        return RequestRecord(
            index,
            prompt="p",
            ok=True,
            text="t",
            end=e2e,
            server_timings=timings if affected else {},
        )

    reference = {"p": run(0, 0.5)}
    baseline = [run(0, 1.0), run(1, 4.0)]
    report = verdict([run(0, 1.5, True), run(1, 4.2, True)], reference, [], {}, {}, baseline)
    assert [a["baseline_s"] for a in report.affected_requests] == [1.0, 4.0]
    assert [a["extra_s"] for a in report.affected_requests] == [0.5, 0.2]
    assert report.extra_latency_p50_s == pytest.approx(0.35)


def test_a_sequence_in_its_last_step_is_not_counted_as_held():
    """It finishes before the signal lands: a kill that 'hit' three of them recovered
    nothing and the drill failed."""
    from bench.drill import choose_victim, held

    ending = {
        "worker_id": "decode-0",
        "role": "decode",
        "alive": True,
        "pid": 1,
        "requests": {"a": "running+blocks", "b": "running+blocks", "c": "running+blocks"},
        "tokens_left": {"a": 1, "b": 1, "c": 0},
    }
    busy = {
        "worker_id": "decode-1",
        "role": "decode",
        "alive": True,
        "pid": 2,
        "requests": {"d": "running+blocks"},
        "tokens_left": {"d": 30},
    }
    assert (held(ending), held(busy)) == (0, 1)
    assert choose_victim([ending, busy], "decode")["worker_id"] == "decode-1"
    assert choose_victim([ending], "decode") is None
