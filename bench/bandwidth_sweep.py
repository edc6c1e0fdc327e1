"""`pdserve bench bandwidth`: how the KV link's bandwidth changes TTFT and ITL.

For each bandwidth cap, a fresh `pdserve serve` starts with the KV transport shaped
to that cap (kv_transfer/shaping.py), the same closed-loop load runs against it
(warm-up excluded), and client-observed TTFT / ITL / TPOT are recorded. The first
token comes from the decode worker in this experiment (`first_token_from: decode`)
so that TTFT includes the transfer, as it does when the first token needs the KV
on the decode side; `--first-token-from prefill` shows the default behaviour.
Writes a table, optional JSON, and a PNG plot.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import yaml
from tqdm import tqdm

from bench.loadgen import LoadSpec, run_load, summarize
from bench.serve_bench import random_prompts
from bench.server_process import ServerProcess


def run_point(args, bandwidth: float | None, model_id: str) -> dict:
    options = {} if bandwidth is None else {"bandwidth_bytes_per_s": bandwidth}
    config = {
        "model": args.model,
        "dtype": args.dtype,
        "transport": args.transport,
        "transport_options": options,
        "first_token_from": args.first_token_from,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(config, handle)
    server = ServerProcess(["--config", handle.name], startup_timeout_s=300)
    try:
        prompts = random_prompts(args.num_prompts, args.prompt_len, args.vocab)
        spec = LoadSpec(
            url=server.url,
            model=model_id,
            prompts=prompts,
            max_tokens=args.output_len,
            concurrency=args.concurrency,
        )
        asyncio.run(run_load(LoadSpec(**{**spec.__dict__, "prompts": prompts[:2]})))
        start = time.perf_counter()
        records = asyncio.run(run_load(spec))
        summary = summarize(records, time.perf_counter() - start)
        kv_s = [r.server_timings.get("kv_transfer_s") or 0.0 for r in records if r.ok]
        summary["kv_transfer_mean_s"] = sum(kv_s) / len(kv_s) if kv_s else None
        return summary
    finally:
        server.stop()
        os.unlink(handle.name)


def run_sweep(args) -> int:
    from engine.demo_model import resolve_model

    _, model_id = resolve_model(args.model)
    caps = [None if c in ("none", "inf") else float(c) * 1e6 for c in args.mbps.split(",")]
    results = []
    for cap in tqdm(caps, desc="bandwidth caps"):
        point = run_point(args, cap, model_id)
        point["bandwidth_mb_s"] = None if cap is None else cap / 1e6
        results.append(point)
    print(format_sweep(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot_sweep(results, args.plot)
    return 0


def format_sweep(results: list[dict]) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [
        f"{'MB/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'TPOT':>7} {'KV xfer':>8} {'tok/s':>7}  (ms)"
    ]
    for r in results:
        cap = "uncapped" if r["bandwidth_mb_s"] is None else f"{r['bandwidth_mb_s']:.0f}"
        lines.append(
            f"{cap:>8} {ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>9} {ms(r['itl_p50_s']):>8} "
            f"{ms(r['tpot_mean_s']):>7} {ms(r['kv_transfer_mean_s']):>8} {r['output_tok_s']:>7.1f}"
        )
    return "\n".join(lines)


def plot_sweep(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capped = sorted(
        (r for r in results if r["bandwidth_mb_s"] is not None), key=lambda r: r["bandwidth_mb_s"]
    )
    uncapped = [r for r in results if r["bandwidth_mb_s"] is None]
    xs = [r["bandwidth_mb_s"] for r in capped]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (
        ("ttft_p50_s", "TTFT p50"),
        ("itl_p50_s", "ITL p50"),
        ("kv_transfer_mean_s", "KV transfer"),
    ):
        line = ax.plot(xs, [1000 * (r[key] or 0) for r in capped], marker="o", label=label)[0]
        if uncapped and key == "ttft_p50_s":  # a log axis has no place for "no cap"
            level = 1000 * sum(r[key] or 0 for r in uncapped) / len(uncapped)
            ax.axhline(level, color=line.get_color(), linestyle="--", label=f"{label}, uncapped")
    ax.set_xscale("log")
    ax.set_xlabel("KV link bandwidth cap (MB/s)")
    ax.set_ylabel("ms")
    ax.set_title("KV transfer bandwidth vs client-observed latency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_bandwidth_parser(kinds) -> None:
    parser = kinds.add_parser(
        "bandwidth",
        help="TTFT and ITL as the KV link bandwidth cap changes (starts one server per cap)",
        description=__doc__,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="demo")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="served dtype"
    )
    parser.add_argument("--transport", default="shm", choices=["shm", "collective", "grpc"])
    parser.add_argument(
        "--mbps", default="none,1000,100,30,10", help="caps in MB/s; 'none' = uncapped"
    )
    parser.add_argument("--first-token-from", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.set_defaults(func=run_sweep)
