"""`pdserve bench serve`: client-observed serving performance of a running server.

Random token-id prompts of an exact length (like `vllm bench serve --dataset-name
random`), a fixed number of output tokens (EOS ignored), a closed loop at the given
concurrency. Warm-up requests run first and are excluded. Reports output tokens/s,
TTFT, ITL, TPOT and end-to-end latency, with failed requests counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from bench.loadgen import LoadSpec, run_load, served_model_id, summarize


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


async def bench_serve(args) -> dict:
    model = args.model or await served_model_id(args.url, args.api_key)
    results = {}
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        prompts = random_prompts(
            args.num_prompts or max(4 * concurrency, 8), args.prompt_len, args.vocab
        )
        spec = LoadSpec(
            url=args.url,
            model=model,
            prompts=prompts,
            max_tokens=args.output_len,
            concurrency=concurrency,
            api_key=args.api_key,
        )
        await run_load(LoadSpec(**{**spec.__dict__, "prompts": prompts[: args.warmup]}))  # warm-up
        start = time.perf_counter()
        records = await run_load(spec)
        results[concurrency] = summarize(records, time.perf_counter() - start)
    return results


def format_results(results: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [
        f"{'conc':>5} {'ok/total':>9} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT':>7} {'ITL p50':>8} {'ITL p99':>8} {'E2E p50':>8}   (ms)"
    ]
    for concurrency, r in results.items():
        lines.append(
            f"{concurrency:>5} {r['completed']:>4}/{r['requests']:<4} {r['output_tok_s']:>10.1f} "
            f"{ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>9} {ms(r['tpot_mean_s']):>7} "
            f"{ms(r['itl_p50_s']):>8} {ms(r['itl_p99_s']):>8} {ms(r['e2e_p50_s']):>8}"
        )
    return "\n".join(lines)


def add_serve_bench_parser(kinds) -> None:
    parser = kinds.add_parser(
        "serve",
        help="client-observed TTFT/ITL/throughput of a running server",
        description="Closed-loop load of random token prompts against a running pdserve (or any "
        "OpenAI-compatible server), warm-up excluded, failures counted.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated concurrency levels")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", default=None)
    parser.set_defaults(func=_run)


def _run(args) -> int:
    results = asyncio.run(bench_serve(args))
    print(format_results(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0
