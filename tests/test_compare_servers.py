"""The side-by-side table: medians per server and point, ratios against vLLM's best."""

from __future__ import annotations

import pytest

from bench.compare_servers import ServerSpec, format_table, parse_servers


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


def steps(fixed: float, per_token: float, per_seq: float, shapes) -> list[dict]:
    return [
        {"prefill_tokens": p, "decode_seqs": d, "seconds": fixed + per_token * p + per_seq * d}
        for p, d in shapes
    ]


def test_the_engine_rate_bound_comes_from_the_fitted_steps():
    from bench.engine_bound import fit, output_bound

    shapes = [(256, 0), (512, 0), (0, 4), (0, 16), (128, 8), (0, 1)]
    prefill = steps(0.01, 0.002, 0.0, shapes)  # 0.522 s per 256-token prompt
    decode = steps(0.02, 0.0, 0.005, shapes)  # 0.1 s per 16-sequence step
    assert fit(prefill) == pytest.approx((0.01, 0.002, 0.0), abs=1e-9)
    traces = {"prefill-0": prefill, "decode-0": decode}
    # prefill allows 1 / 0.522 req/s x 64 tokens = 122.6 tok/s; decode 16 / 0.1 = 160
    assert output_bound(traces, 256, 64, 16) == pytest.approx(64 / 0.522, rel=1e-6)
    colocated = {"colocated-0": steps(0.01, 0.002, 0.005, shapes)}
    per_request = 0.522 + 64 * (0.01 + 0.005 * 16) / 16
    assert output_bound(colocated, 256, 64, 16) == pytest.approx(64 / per_request, rel=1e-6)


def test_a_pdserve_server_carries_its_own_flags_and_is_labelled_by_them():
    servers = parse_servers(
        "vllm-fp32,pdserve-colocated,pdserve-colocated@--prefill-batch-tokens=1024+--max-num-seqs=32"
    )
    assert [s.kind for s in servers] == ["vllm-fp32", "pdserve-colocated", "pdserve-colocated"]
    assert servers[2].flags == ("--prefill-batch-tokens=1024", "--max-num-seqs=32")
    assert servers[2].label == "pdserve-colocated --prefill-batch-tokens=1024 --max-num-seqs=32"
    results = [
        {"server": s.label, "points": [point("concurrency=16", 60.0 + i, 3.0)]}
        for i, s in enumerate(servers)
    ]
    rows = format_table(results).splitlines()
    assert any(row.startswith(servers[2].label + " ") and "62.0 (1.03x)" in row for row in rows)


@pytest.mark.parametrize("text", ["pdserve-fast", "vllm-fp32@--dtype=bfloat16"])
def test_an_unknown_server_or_flags_on_vllm_are_refused(text):
    with pytest.raises(ValueError, match=r"pdserve serve|expected one of"):
        ServerSpec.parse(text)


def test_a_server_that_fails_does_not_lose_the_others(monkeypatch, tmp_path, capsys):
    """A pdserve setting that its config refuses (or a server that dies) is reported as
    failed; the servers measured before and after it keep their rows and their JSON."""
    import argparse
    import json

    import bench.compare_servers as compare
    import bench.prompt_text

    async def fake_measure(server, args, maker):
        if "256" in server.label:
            raise RuntimeError("server exited with 1: ConfigError: prefill_chunk_size ...")
        return {"server": server.label, "points": [point("concurrency=16", 80.0, 2.0)]}

    monkeypatch.setattr(compare, "measure", fake_measure)
    monkeypatch.setattr(bench.prompt_text.PromptMaker, "from_arg", staticmethod(lambda _: None))
    out = tmp_path / "compare.json"
    args = argparse.Namespace(
        servers="vllm-fp32,pdserve-colocated@--max-batch-tokens=256,pdserve-colocated",
        tokenizer="demo",
        json=str(out),
        from_json=None,
        plot=None,
        kind=None,
        dtype="auto",
        repeats=1,
    )
    assert compare._run(args) == 1
    printed = capsys.readouterr().out
    assert "pdserve-colocated --max-batch-tokens=256: FAILED" in printed
    assert any(line.startswith("pdserve-colocated ") for line in printed.splitlines())
    report = json.loads(out.read_text())
    assert [r["server"] for r in report["servers"]] == ["vllm-fp32", "pdserve-colocated"]
    assert report["failed"][0]["server"] == "pdserve-colocated --max-batch-tokens=256"


def sitting_point(label: str, runs: list[tuple[float, float]]) -> dict:
    """A point as compare-servers writes it: each run's summary, and their medians."""
    summaries = [
        {"output_throughput": tok_s, "ttft_p50_s": ttft, "tpot_p50_s": 0.04, "itl_p99_s": 0.09}
        for tok_s, ttft in runs
    ]
    median = sorted(summaries, key=lambda s: s["output_throughput"])[len(summaries) // 2]
    return {"label": label, "runs": [{"summary": s} for s in summaries], "summary": median}


def test_a_saved_sitting_is_tabled_and_drawn_again_without_starting_anything(tmp_path):
    """`--from-json` reads a report `--json` wrote: the same table, and `--plot` draws it
    (a bar per server and figure at each point, min-max whiskers, ratios)."""
    import json
    import subprocess
    import sys

    servers = {
        "vllm-fp32": [(19.0, 0.52), (19.9, 0.51), (20.2, 0.53)],
        "pdserve-colocated": [(27.9, 0.45), (32.7, 0.44), (33.2, 0.46)],
        "pdserve-disaggregated": [(20.1, 0.70), (22.7, 0.71), (24.0, 0.69)],
    }
    report = {
        "machine": {"cpu_model": "AMD EPYC", "logical_cpus": 2},
        "servers": [
            {
                "server": name,
                "points": [
                    sitting_point("concurrency=1", runs),
                    sitting_point("concurrency=16", runs),
                ],
            }
            for name, runs in servers.items()
        ],
        "failed": [],
    }
    saved, png = tmp_path / "sitting.json", tmp_path / "sitting.png"
    saved.write_text(json.dumps(report))
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "compare-servers",
         "--from-json", str(saved), "--plot", str(png)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert format_table(report["servers"]) in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("pdserve-colocated"))
    assert "32.7 (1.64x)" in row
    assert png.stat().st_size > 20_000
