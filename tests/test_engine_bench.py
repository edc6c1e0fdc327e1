"""`pdserve bench engine` keeps its two kinds of figure apart and says what each holds."""

from __future__ import annotations

from bench.engine_bench import EngineBenchResult, format_report


def test_report_separates_steady_state_decode_from_end_to_end():
    result = EngineBenchResult(
        model="m",
        dtype="float32",
        threads=2,
        kernels="native ops, native attention",
        prompt_len=256,
        decode_steps=32,
        repeats=3,
        cpu="AMD EPYC",
        read_bandwidth_gbps=25.0,
        weight_bytes=538_000_000,
        weight_roofline_ms=21.5,
        weight_roofline_ratio=1.09,
        ours_step_ms={1: 23.0, 16: 60.0},
        roofline_step_ms={1: 22.0, 16: 30.0},
        ours_prefill_tok_s=600.0,
        ours_e2e_tok_s={16: 150.0},
        hf_step_ms={1: 40.0, 16: 200.0},
        hf_e2e_tok_s={16: 30.0},
        hf_cb_tok_s={16: 25.0},
        thread_choice={"decode 1 rows": {1: 25.0, 2: 23.0}},
        phase_ms={
            1: {"qkv": 2.0, "attention": 1.0, "lm_head": 19.0},
            16: {"qkv": 6.0, "attention": 15.0, "lm_head": 30.0},
        },
    )

    report = format_report(result)

    assert "Steady-state decode" in report and "prefill included" in report
    assert (
        "CPU AMD EPYC" in report
        and "read bandwidth 25.00 GB/s (probed around each batch-1 run)" in report
    )
    # The per-run ratios' median, not the ratio of the medians (23.0 / 21.5 = 1.07).
    assert "batch-1 step / weight roofline = 1.09, the median of each run" in report
    assert "(weights streamed at 23.4 GB/s" in report
    steady = next(line for line in report.splitlines() if line.split()[:1] == ["16"])
    assert steady.split()[-1] == "3.33"  # ours vs HF, both steady state (200 / 60 ms)
    assert "decode 1 rows: 1 thr 25.0 ms, 2 thr 23.0 ms" in report
    # --phases: ms per step in each phase, its share of the timed step, then the sum
    phases = report.split("Where a decode step goes")[1].splitlines()
    assert phases[3].split() == ["attention", "1.00", "(4.3%)", "15.00", "(25.0%)"]
    assert phases[5].split() == ["sum", "22.00", "51.00"]
    assert phases[6].split() == ["step", "23.00", "60.00"]
