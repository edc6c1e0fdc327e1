"""The bandwidth sweep's crossover plot: auto's switch point computed from measured costs."""

from __future__ import annotations

from types import SimpleNamespace

from bench.crossover import crossover_points, plot_crossover, prefill_costs, receipt_costs

BLOCK_BYTES = 737_280


def _steps(fixed_s=0.08, per_token_s=0.004):
    trace = [
        {
            "started": 0.0,
            "seconds": fixed_s + per_token_s * n,
            "decode_seqs": 0,
            "prefill_seqs": 1,
            "prefill_tokens": n,
        }
        for n in (16, 128, 512, 512)
    ]
    decode = [
        {"started": 0.0, "seconds": 0.1, "decode_seqs": 4, "prefill_seqs": 0, "prefill_tokens": 0}
    ]
    return {"prefill-0": trace, "decode-0": decode}


def _point(mb_s, paths=()):
    return {
        "bandwidth_mb_s": mb_s,
        "kv_bandwidth_measured": None if mb_s is None else mb_s * 1e6,
        "kv_block_bytes": BLOCK_BYTES,
        "call_overhead_s": 0.005,
        "prefill_costs": prefill_costs(_steps()),
        "paths": list(paths),
    }


def test_the_crossover_needs_longer_prompts_on_slower_links(tmp_path):
    results = [
        _point(1000, [(256, "remote")]),
        _point(100),
        _point(30),
        _point(5, [(256, "local")]),
    ]
    points = crossover_points(results, 16, 512, running=3)
    by_bw = dict(points)
    assert by_bw[1000] <= by_bw[100] <= by_bw[30]
    assert by_bw[5] is None  # moving a token's KV is slower than computing it
    path = tmp_path / "crossover.png"
    plot_crossover(results, str(path), 16, 512, 3)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_receipts_give_block_bytes_bandwidth_and_chosen_paths():
    timings = {
        "kv_blocks_moved": 4,
        "kv_bytes": 4 * BLOCK_BYTES,
        "kv_transfer_s": 0.01,
        "ttft_parts": {"prefill_call_overhead_s": 0.004},
        "disaggregation": {"path": "remote"},
    }
    record = SimpleNamespace(ok=True, server_timings=timings, prompt_tokens=300)
    got = receipt_costs([record, record])
    assert got["kv_block_bytes"] == BLOCK_BYTES
    assert got["kv_bandwidth_measured"] == 4 * BLOCK_BYTES / 0.01
    assert got["call_overhead_s"] == 0.004 and got["paths"] == [(300, "remote")] * 2
