"""The bandwidth sweep's plot: capped points on a log axis, uncapped runs as a line."""

from __future__ import annotations

from bench.bandwidth_sweep import plot_sweep


def _point(mb_s, ttft_s, transfer_s):
    return {
        "bandwidth_mb_s": mb_s,
        "ttft_p50_s": ttft_s,
        "itl_p50_s": 0.05,
        "kv_transfer_mean_s": transfer_s,
    }


def test_plot_has_capped_points_and_an_uncapped_reference(tmp_path):
    results = [_point(None, 0.6, 0.007), _point(10, 1.2, 0.59), _point(300, 0.6, 0.02)]
    results.append(_point(None, 0.7, 0.007))
    path = tmp_path / "sweep.png"

    plot_sweep(results, str(path))

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
