"""`pdserve bench bandwidth --kv-modes`: the expected-TTFT arithmetic (whole vs pipelined
chunks), the GPU projection, the expected values put beside measured points, the plots
and the CLI's flags. No cluster: the sweep itself is a benchmark, run by hand."""

from __future__ import annotations

import pytest

from bench.kv_stream_model import (
    GPU_LINKS_GBIT,
    GPU_MODELS,
    chunk_sizes,
    expected_ttft,
    gpu_projection,
    streamed_finish,
    whole_finish,
)
from bench.kv_stream_plot import plot_gpu_projection, plot_measured
from bench.kv_stream_sweep import KV_MODES, SweepSpec, add_expected, caps_for, parse_caps
from cluster.cli.main import build_parser


def test_chunks_cut_the_prompt_and_the_last_keeps_the_rest():
    assert chunk_sizes(1300, 512) == [512, 512, 276]
    assert chunk_sizes(512, 512) == [512]


def test_a_pipeline_hides_the_shorter_of_compute_and_transfer_but_one_chunk():
    compute, transfer = [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]
    assert whole_finish(compute, transfer) == 6.0
    assert streamed_finish(compute, transfer) == 4.5  # compute-bound: + the last transfer
    compute, transfer = [0.5] * 4, [1.0] * 4
    assert streamed_finish(compute, transfer) == 4.5  # link-bound: the first chunk + all
    assert streamed_finish([2.0], [3.0]) == whole_finish([2.0], [3.0]) == 5.0  # one chunk


def test_expected_ttft_adds_the_fixed_overheads_to_both():
    expected = expected_ttft(2048, 512, compute_s=4.0, kv_bytes=400.0, bandwidth=100.0, base_s=0.25)
    assert expected.whole_s == pytest.approx(0.25 + 4.0 + 4.0)
    assert expected.streamed_s == pytest.approx(0.25 + 1.0 + 4.0)  # link-bound after chunk 1
    assert expected.transfer_s == pytest.approx(4.0)


def test_the_gpu_projection_covers_both_models_every_link_and_never_loses_to_whole():
    rows = gpu_projection((512, 2048, 8192))
    assert len(rows) == len(GPU_MODELS) * len(GPU_LINKS_GBIT) * 3
    for row in rows:
        assert row["streamed_s"] <= row["whole_s"] + 1e-12
        if row["prompt"] == 512:  # one chunk: nothing to overlap
            assert row["streamed_s"] == pytest.approx(row["whole_s"])
    slow = next(r for r in rows if r["model"] == "Llama-3-8B" and r["link_gbit"] == 25)
    assert slow["transfer_s"] == pytest.approx(512 * 131072 / (25e9 / 8))  # 128 KiB/token


def _row(mode, mb_s, prompt, ttft, prefill, xfer, exposed):
    return {
        "bandwidth_mb_s": mb_s,
        "prompt": prompt,
        "mode": mode,
        "chunk": 512,
        "requests": 1,
        "all_ok": True,
        "ttft_p50_s": ttft,
        "ttft_p99_s": ttft,
        "itl_p50_s": 0.03,
        "prefill_s_mean": prefill,
        "kv_transfer_s_mean": xfer,
        "hidden_s_mean": xfer - exposed,
        "exposed_s_mean": exposed,
        "kv_bytes_mean": 100e6,
        "segments": 4 if mode.startswith("chunk") else 1,
    }


def test_expected_values_sit_beside_each_measured_point():
    rows = [
        _row("whole-pull", None, 2048, 4.2, 4.0, 0.05, 0.05),
        _row("whole-pull", 12.5, 2048, 12.2, 4.0, 8.0, 8.0),
        _row("chunk-pull", 12.5, 2048, 9.3, 4.0, 8.0, 1.1),
    ]
    add_expected(rows)
    base = 4.2 - 4.0 - 0.05
    whole, chunk = rows[1], rows[2]
    assert whole["expected_s"] == pytest.approx(base + 4.0 + 8.0)
    assert chunk["expected_s"] == pytest.approx(base + 1.0 + 8.0)  # link-bound
    assert chunk["expected_whole_s"] == whole["expected_s"]


def test_long_prompts_run_at_the_caps_named_for_them():
    spec = SweepSpec(
        "demo",
        "float32",
        parse_caps("12.5,125,none"),
        list(KV_MODES),
        [512, 2048],
        1,
        parse_caps("125,none"),
    )
    assert caps_for(512, spec) == [12.5e6, 125e6, None]
    assert caps_for(2048, spec) == [125e6, None]


def test_plots_are_written(tmp_path):
    rows = []
    for mode in KV_MODES:
        for cap in (12.5, 125.0, None):
            rows.append(_row(mode, cap, 2048, 5.0, 4.0, 1.0, 0.5))
    add_expected(rows)
    measured, projected = tmp_path / "m.png", tmp_path / "g.png"
    plot_measured(rows, str(measured))
    plot_gpu_projection([512, 2048, 8192], str(projected))
    for path in (measured, projected):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_takes_the_streaming_flags():
    args = build_parser().parse_args(
        [
            "bench",
            "bandwidth",
            "--kv-modes",
            "chunk-pull,chunk-push",
            "--prompt-lens",
            "512",
            "--long-mbps",
            "none",
            "--requests",
            "2",
            "--gpu-plot",
            "g.png",
        ]
    )
    assert args.kv_modes == "chunk-pull,chunk-push" and args.requests == 2
