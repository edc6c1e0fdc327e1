"""The side-by-side table: medians per server and point, ratios against vLLM's best."""

from __future__ import annotations

from bench.compare_servers import format_table


def point(label: str, tok_s: float, ttft: float) -> dict:
    summary = {"output_throughput": tok_s, "ttft_p50_s": ttft, "tpot_p50_s": 0.05}
    return {"label": label, "summary": summary}


def test_ratios_are_against_the_best_vllm_configuration_at_each_point():
    results = [
        {"server": "vllm-fp32", "points": [point("concurrency=1", 20.0, 0.5)]},
        {"server": "vllm-default", "points": [point("concurrency=1", 10.0, 3.0)]},
        {"server": "pdserve-colocated", "points": [point("concurrency=1", 25.0, 0.4)]},
    ]
    table = format_table(results)
    row = next(line for line in table.splitlines() if line.startswith("pdserve-colocated"))
    assert "25.0 (1.25x)" in row and "400 (0.80x)" in row
    assert "ITL" in table and "-" in row  # a figure a server did not report stays blank
