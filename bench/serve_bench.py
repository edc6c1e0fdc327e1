"""`pdserve bench serve`: client-observed serving performance of any OpenAI-compatible server.

It drives pdserve, vLLM or any other server speaking the OpenAI API (`--url`,
`--endpoint completions|chat`, `--model`). A run: the workload is built with the
model's tokenizer (exact token counts), warm-up requests go first and are kept out
of the results, then requests are released by a closed loop (`--concurrency`), an
open loop (`--rate`, `--arrival`), or both, for `--num-prompts` sessions or
`--duration` seconds. Per request it records TTFT, every inter-token gap, TPOT, E2E,
tokens and the outcome; failures are counted in every denominator. It prints a
report with the metric definitions, and writes JSON (every record plus a header) and
CSV. A comma list for --concurrency or --rate runs one point per value.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import replace

from bench.arrivals import ARRIVALS, ArrivalSpec
from bench.report import (
    build_header,
    format_definitions,
    format_point,
    format_table,
    point_entry,
    run_entry,
    write_csv,
    write_json,
)
from bench.runner import RunSpec, run_once
from bench.summary import Slo
from bench.workloads import ENDPOINTS, KINDS, WorkloadSpec

TOOL = "pdserve bench serve"


def add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument(
        "--endpoint", default="completions", choices=ENDPOINTS, help="OpenAI API to call"
    )
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--tokenizer",
        default="demo",
        help="'demo' or a local HF tokenizer directory: exact prompt token counts",
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (token counts through --tokenizer)")
    group.add_argument("--workload", default="random", choices=KINDS, help="what to send")
    group.add_argument(
        "--prompt-len",
        default="256",
        help="prompt tokens (multi-turn: per user turn): N, LOW-HIGH or normal:MEAN,STD",
    )
    group.add_argument(
        "--output-len",
        default=None,
        help="output tokens, same forms (default 64; jsonl/sharegpt: the dataset's own)",
    )
    group.add_argument("--dataset", default=None, help="jsonl or ShareGPT JSON file")
    group.add_argument("--num-groups", type=int, default=4, help="shared-prefix: system prompts")
    group.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system tokens")
    group.add_argument(
        "--question-len", type=int, default=64, help="shared-prefix: unique question tokens"
    )
    group.add_argument("--turns", type=int, default=3, help="multi-turn: user turns per chat")
    group.add_argument(
        "--token-ids",
        action="store_true",
        help="random workload on completions: send token ids instead of text",
    )
    group.add_argument(
        "--max-context", type=int, default=2048, help="jsonl/sharegpt: skip longer entries"
    )
    group.add_argument("--seed", type=int, default=0, help="same seed, same prompts and arrivals")


def add_run_args(parser: argparse.ArgumentParser, lists: bool = True) -> None:
    group = parser.add_argument_group("arrival process and run length")
    several = " (comma list: one point per value)" if lists else ""
    group.add_argument("--concurrency", default=None, help=f"closed loop / in-flight cap{several}")
    group.add_argument("--rate", default=None, help=f"open loop: requests per second{several}")
    group.add_argument("--arrival", default="poisson", choices=ARRIVALS, help="open-loop gaps")
    group.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: <1 burstier, >1 more regular"
    )
    group.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="sessions per run (default 4 x concurrency, >= 16)",
    )
    group.add_argument("--duration", type=float, default=None, help="seconds instead of a count")
    group.add_argument("--warmup", type=int, default=2, help="warm-up requests, excluded")
    group.add_argument("--repeats", type=int, default=1, help="runs per point: min/median/max")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    out = parser.add_argument_group("sampling and output")
    out.add_argument(
        "--temperature",
        default="0",
        help="sent as temperature; 'server' leaves it to the server's default",
    )
    out.add_argument(
        "--no-ignore-eos", action="store_true", help="let EOS end outputs early (no ignore_eos)"
    )
    out.add_argument("--slo", default=None, help="goodput bounds: ttft_ms=500,tpot_ms=100,e2e_ms=")
    out.add_argument("--json", default=None, help="write the JSON report here")
    out.add_argument("--csv", default=None, help="write one CSV row per request here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        kind=args.workload,
        endpoint=args.endpoint,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        dataset=args.dataset,
        num_groups=args.num_groups,
        prefix_len=args.prefix_len,
        question_len=args.question_len,
        turns=args.turns,
        token_ids=args.token_ids,
        max_context=args.max_context,
        seed=args.seed,
    )


def _numbers(text: str | None, kind=float) -> list:
    return [None] if text is None else [kind(v) for v in str(text).split(",") if v.strip()]


def run_spec_from_args(args, model: str, concurrency=None, rate=None) -> RunSpec:
    arrival = ArrivalSpec(rate, concurrency, args.arrival, args.burstiness)
    num_prompts = args.num_prompts
    if num_prompts is None and args.duration is None:
        num_prompts = max(16, 4 * (concurrency or 4))
    temperature = None if args.temperature == "server" else float(args.temperature)
    return RunSpec(
        url=args.url.rstrip("/"),
        model=model,
        workload=workload_from_args(args),
        arrival=arrival,
        num_prompts=num_prompts,
        duration_s=args.duration,
        warmup=args.warmup,
        ignore_eos=not args.no_ignore_eos,
        temperature=temperature,
        api_key=args.api_key,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        slo=Slo.parse(args.slo),
        seed=args.seed,
    )


def expand_points(args, model: str) -> list[tuple[str, dict, RunSpec]]:
    """One (label, variable, spec) per value of --concurrency or --rate (one may be a list)."""
    concurrencies, rates = _numbers(args.concurrency, int), _numbers(args.rate)
    if len(concurrencies) > 1 and len(rates) > 1:
        raise ValueError("give a list for --concurrency or for --rate, not both")
    points = []
    for c in concurrencies:
        for r in rates:
            spec = run_spec_from_args(args, model, c, r)
            variable = {"concurrency": c} if len(rates) == 1 else {"rate": r}
            label = ", ".join(f"{k}={v:g}" for k, v in variable.items() if v is not None)
            points.append((label or spec.arrival.describe(), variable, spec))
    return points


async def run_points(points, maker, repeats: int, printer=print) -> list[dict]:
    """Every point `repeats` times, each run with its own warm-up; prints as it goes.

    Each run draws its own prompts (seed + run number): a server with a prefix cache
    (vLLM's is on by default) would otherwise serve a repeat from it.
    """
    entries, run_number = [], 0
    for label, variable, spec in points:
        runs = []
        for _ in range(repeats):
            run_spec = replace(spec, seed=spec.seed + run_number)
            runs.append(run_entry(await run_once(run_spec, maker)))
            run_number += 1
        entries.append(point_entry(label, variable, runs))
        printer(format_point(entries[-1]))
    return entries


async def resolve_model_name(args) -> str:
    if args.model:
        return args.model
    from bench.loadgen import served_model_id

    return await served_model_id(args.url.rstrip("/"), args.api_key)


def add_serve_bench_parser(kinds) -> None:
    parser = kinds.add_parser(
        "serve",
        help="client-observed TTFT/ITL/TPOT/throughput of any OpenAI-compatible server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_args(parser)
    add_workload_args(parser)
    add_run_args(parser)
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also draw each point: its requests over time, TTFT / E2E and inter-token gap "
        "distributions, chunks per second",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bench.prompt_text import PromptMaker

    if args.concurrency is None and args.rate is None:
        args.concurrency = "1"
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    maker = PromptMaker.from_arg(args.tokenizer)
    model = asyncio.run(resolve_model_name(args))
    points = expand_points(args, model)
    header = build_header(TOOL, args.url, model, args.tokenizer, points[0][2])
    print(_header_line(header, points[0][2]))
    entries = asyncio.run(run_points(points, maker, args.repeats))
    header["machine_after"] = {"load_average": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        write_json(args.json, header, entries)
    if args.csv:
        write_csv(args.csv, entries)
    if args.plot:
        from bench.serve_plot import plot_run

        print(f"plot: {plot_run(entries, args.plot)}")
    if len(entries) > 1:
        print(format_table(entries))
    print(format_definitions())
    return 0


def _header_line(header: dict, spec: RunSpec) -> str:
    w = spec.workload
    default_output = "the dataset's" if w.kind in ("jsonl", "sharegpt") else "64"
    lengths = f"prompt {w.prompt_len}, output {w.output_len or default_output}"
    if w.kind == "shared-prefix":
        lengths = f"{w.num_groups} groups, prefix {w.prefix_len} + question {w.question_len}"
    run = f"{spec.num_prompts} sessions" if spec.num_prompts else f"{spec.duration_s:g} s"
    return (
        f"{TOOL} -> {header['url']} ({w.endpoint}, model {header['model']})\n"
        f"workload {w.kind}: {lengths}{'' if spec.ignore_eos else ' (EOS may end early)'}; "
        f"{run} per run, {spec.warmup} warm-up excluded; {header['machine']['cpu_model']}, "
        f"load {header['machine']['load_average']}"
    )
