"""`pdserve bench bandwidth`: how the KV link's bandwidth changes TTFT and ITL.

With `--kv-modes` it compares whole-prompt and chunk-streamed KV, pulled and pushed,
at several prompt lengths instead (bench/kv_stream_sweep.py). Otherwise:
For each first-token mode and each bandwidth cap, a fresh `pdserve serve` starts
with the KV transport shaped to that cap (kv_transfer/shaping.py) and the same
`bench serve` workload runs against it (closed loop, warm-up excluded). With
`first_token_from: decode` the first token needs the KV on the decode side, so TTFT
includes the transfer; with `prefill` (pdserve's default) the prefill worker streams
the first token and the transfer overlaps it. Both modes run by default, so one
sweep shows what the default hides. Next to each measured transfer time it puts the
expected one, KV bytes per request (from `pdserve_timings`) / cap. Writes a table,
optional JSON, and a PNG plot.

`--crossover PNG` also plots, from the costs each server measured (the prefill
worker's step trace, the achieved bandwidth, the call overhead), the prompt length
above which `disaggregation: auto` prefills remotely at each bandwidth
(bench/crossover.py); with `--disaggregation auto` the servers run that policy and
the plot marks the path each request took.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import requests
import yaml
from tqdm import tqdm

from bench.arrivals import ArrivalSpec
from bench.crossover import plot_crossover, prefill_costs, receipt_costs
from bench.prompt_text import PromptMaker
from bench.report import ms
from bench.runner import RunSpec, run_once
from bench.serve_bench import add_workload_args, workload_from_args
from bench.server_process import ServerProcess

MODES = ("decode", "prefill")


def run_point(args, bandwidth: float | None, mode: str, spec: RunSpec, port=None) -> dict:
    transport = {"name": args.transport}
    if bandwidth is not None:
        transport["bandwidth_bytes_per_s"] = bandwidth
    config = {
        "model": args.model,
        "dtype": args.dtype,
        "transport": transport,
        "first_token_from": mode,
        "disaggregation": args.disaggregation,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(config, handle)
    server = ServerProcess(["--config", handle.name], startup_timeout_s=300, port=port)
    try:
        result = asyncio.run(run_once(replace(spec, url=server.url), args.maker))
        steps = requests.get(f"{server.url}/admin/steps", params={"last": 4096}, timeout=30)
    finally:
        server.stop()
        os.unlink(handle.name)
    point = point_summary(result.summary, result.records, bandwidth, mode)
    point.update(receipt_costs(result.records), prefill_costs=prefill_costs(steps.json()))
    return point


def point_summary(summary: dict, records, bandwidth: float | None, mode: str) -> dict:
    done = [r for r in records if r.ok and r.server_timings]
    kv_s = [r.server_timings.get("kv_transfer_s") or 0.0 for r in done]
    kv_bytes = [r.server_timings.get("kv_bytes") or 0 for r in done]
    mean_bytes = sum(kv_bytes) / len(kv_bytes) if kv_bytes else None
    return {
        **summary,
        "first_token_from": mode,
        "bandwidth_mb_s": None if bandwidth is None else bandwidth / 1e6,
        "kv_transfer_mean_s": sum(kv_s) / len(kv_s) if kv_s else None,
        "kv_bytes_mean": mean_bytes,
        "kv_expected_s": None
        if bandwidth is None or mean_bytes is None
        else mean_bytes / bandwidth,
    }


def run_sweep(args) -> int:
    if args.kv_modes:
        from bench.kv_stream_sweep import run_stream_sweep

        return run_stream_sweep(args)
    from engine.demo_model import resolve_model

    directory, model_id = resolve_model(args.model)
    args.maker = PromptMaker.from_arg(str(directory))
    caps = [None if c in ("none", "inf") else float(c) * 1e6 for c in args.mbps.split(",")]
    modes = [m.strip() for m in args.first_token_from.split(",")]
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--first-token-from takes {', '.join(MODES)} (comma list)")
    spec = RunSpec(
        url="",
        model=model_id,
        workload=workload_from_args(args),
        arrival=ArrivalSpec(concurrency=args.concurrency),
        num_prompts=args.num_prompts,
        warmup=args.warmup,
        progress=False,
        seed=args.seed,
    )
    results = []
    points = [(m, c) for m in modes for c in caps]
    for index, (mode, cap) in enumerate(tqdm(points, desc="servers (mode, cap)")):
        port = args.port + index if args.port else None
        results.append(run_point(args, cap, mode, spec, port))
    print(format_sweep(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot_sweep(results, args.plot)
    if args.crossover:
        running = max(1, args.concurrency - 1)
        crossings = plot_crossover(results, args.crossover, 16, 512, running)
        print(format_crossover(crossings, running))
    return 0


def format_crossover(points: list, running: int) -> str:
    lines = [f"auto's crossover (decode worker running {running}): remote from this prompt length"]
    for mbps, tokens in points:
        where = f"{tokens} tokens" if tokens is not None else "never (local at every length)"
        lines.append(f"  {mbps:>10.1f} MB/s  {where}")
    return "\n".join(lines)


def format_sweep(results: list[dict]) -> str:
    lines = [
        f"{'1st token':<10}{'MB/s':>9}{'TTFT p50':>9}{'TTFT p99':>9}{'ITL p50':>8}{'TPOT':>7}"
        f"{'KV xfer':>8}{'expected':>9}{'tok/s':>7}  (ms)"
    ]
    for r in results:
        cap = "uncapped" if r["bandwidth_mb_s"] is None else f"{r['bandwidth_mb_s']:.0f}"
        lines.append(
            f"{r.get('first_token_from', '-'):<10}{cap:>9}{ms(r['ttft_p50_s']):>9}"
            f"{ms(r['ttft_p99_s']):>9}{ms(r['itl_p50_s']):>8}{ms(r['tpot_mean_s']):>7}"
            f"{ms(r['kv_transfer_mean_s']):>8}{ms(r.get('kv_expected_s')):>9}"
            f"{r['output_throughput']:>7.1f}"
        )
    return "\n".join(lines)


def plot_sweep(results: list[dict], path: str) -> None:
    """TTFT per first-token mode, ITL, and measured vs expected transfer time, per cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    modes = sorted({r.get("first_token_from", "decode") for r in results})
    for mode in modes:
        rows = [r for r in results if r.get("first_token_from", "decode") == mode]
        _plot_mode(ax, rows, mode, first=mode == modes[0])
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("KV link bandwidth cap (MB/s)")
    ax.set_ylabel("ms")
    ax.set_title("KV link bandwidth vs client-observed latency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_mode(ax, rows: list[dict], mode: str, first: bool) -> None:
    capped = sorted((r for r in rows if r["bandwidth_mb_s"] is not None), key=_cap)
    uncapped = [r for r in rows if r["bandwidth_mb_s"] is None]
    xs = [r["bandwidth_mb_s"] for r in capped]
    line = ax.plot(xs, _ms(capped, "ttft_p50_s"), marker="o", label=f"TTFT p50 (1st from {mode})")
    if uncapped:  # a log axis has no place for "no cap": a level line instead
        level = sum(r["ttft_p50_s"] or 0 for r in uncapped) / len(uncapped) * 1000
        ax.axhline(
            level, color=line[0].get_color(), linestyle=":", label=f"TTFT, uncapped ({mode})"
        )
    if not first:
        return  # ITL and the transfer do not depend on the first-token mode: draw once
    ax.plot(xs, _ms(capped, "itl_p50_s"), marker="s", label="ITL p50")
    measured = ax.plot(xs, _ms(capped, "kv_transfer_mean_s"), marker="^", label="KV transfer")
    ax.plot(
        xs,
        _ms(capped, "kv_expected_s"),
        linestyle="--",
        marker="x",
        color=measured[0].get_color(),
        label="KV transfer expected (bytes / cap)",
    )


def _cap(row: dict) -> float:
    return row["bandwidth_mb_s"]


def _ms(rows: list[dict], key: str) -> list[float]:
    return [1000 * (r.get(key) or 0) for r in rows]


def add_bandwidth_parser(kinds) -> None:
    parser = kinds.add_parser(
        "bandwidth",
        help="TTFT and ITL as the KV link bandwidth cap changes (starts one server per cap)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="demo", help="served model (also the tokenizer)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="served dtype"
    )
    parser.add_argument("--transport", default="shm", choices=["shm", "collective", "grpc"])
    parser.add_argument(
        "--mbps", default="none,1000,100,30,10", help="caps in MB/s; 'none' = uncapped"
    )
    parser.add_argument(
        "--first-token-from",
        default="decode,prefill",
        help="comma list of modes, each with every cap (decode: TTFT includes the transfer)",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop concurrency")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per server")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests, excluded")
    add_workload_args(parser)
    parser.set_defaults(endpoint="completions", output_len="32", token_ids=False)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument(
        "--disaggregation",
        default="always",
        choices=["always", "auto"],
        help="the servers' policy (auto: the crossover plot marks each request's path)",
    )
    parser.add_argument(
        "--crossover",
        default=None,
        help="write a PNG of where `disaggregation: auto` switches (prompt length x bandwidth)",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="first server's port (then +1 each; default: free)"
    )
    streaming = parser.add_argument_group(
        "streamed KV (bench/kv_stream_sweep.py): with --kv-modes, one in-process cluster per "
        "cap, first_token_from: decode, requests one at a time per prompt length and mode"
    )
    streaming.add_argument(
        "--kv-modes",
        default=None,
        help="comma list of whole-pull, chunk-pull, whole-push, chunk-push (runs this sweep)",
    )
    streaming.add_argument(
        "--prompt-lens", default="512,2048,8000", help="prompt lengths in tokens (comma list)"
    )
    streaming.add_argument(
        "--requests", type=int, default=3, help="timed requests per point (one at a time)"
    )
    streaming.add_argument(
        "--long-mbps",
        default=None,
        help="the caps (MB/s, of --mbps) prompts over 1024 tokens run at (default: all)",
    )
    streaming.add_argument(
        "--gpu-plot", default=None, help="write the GPU projection (a model) as a PNG here"
    )
    parser.set_defaults(func=run_sweep)
