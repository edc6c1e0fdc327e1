"""`pdserve bench sweep`: one variable at a time, the others held, each point a full run.

The method: vary the prompt length at a fixed output length and concurrency; then
the concurrency at fixed lengths; or the request rate. Changing everything at once
tells nothing about which change did what. Every point is a complete `bench serve`
run (its own warm-up, its own /metrics delta), written into one JSON report with the
same layout as `bench serve`'s, so `bench compare` reads sweeps too.

Plots: TTFT p50/p99, ITL p50/p99 and output throughput against the swept variable
(`PREFIX.png`), and latency against throughput across the points (`PREFIX_pareto.png`),
where the points no other point beats on both are joined as the frontier.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

from bench.report import build_header, format_definitions, format_table, write_csv, write_json
from bench.serve_bench import (
    add_run_args,
    add_target_args,
    add_workload_args,
    resolve_model_name,
    run_points,
    run_spec_from_args,
)

VARIABLES = ("prompt-len", "output-len", "concurrency", "rate")


def sweep_points(args, model: str) -> list[tuple[str, dict, object]]:
    """(label, variable, RunSpec) per value of --vary, the rest of the flags held."""
    points = []
    for raw in [v.strip() for v in args.values.split(",") if v.strip()]:
        value = float(raw) if args.vary == "rate" else int(raw)
        concurrency = int(args.concurrency) if args.concurrency else None
        rate = float(args.rate) if args.rate else None
        if args.vary == "concurrency":
            concurrency = value
        elif args.vary == "rate":
            rate = value
        spec = run_spec_from_args(args, model, concurrency, rate)
        if args.vary in ("prompt-len", "output-len"):
            field = args.vary.replace("-", "_")
            spec = replace(spec, workload=replace(spec.workload, **{field: str(value)}))
        points.append((f"{args.vary}={value:g}", {args.vary: value}, spec))
    return points


def plot_sweep(points: list[dict], variable: str, prefix: str) -> list[str]:
    """Writes PREFIX.png (figures against the variable) and PREFIX_pareto.png; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["variable"][variable] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, metric, title in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, _series(points, f"{metric}_{q}_s", 1000), style, label=f"{title} {q}")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} vs {variable}")
    axes[2].plot(xs, _series(points, "output_throughput"), "o-", label="output tok/s")
    axes[2].set_ylabel("tokens/s")
    axes[2].set_title(f"throughput vs {variable}")
    for ax in axes:
        ax.set_xlabel(variable)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [f"{prefix}.png", f"{prefix}_pareto.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    _plot_pareto(points, variable, paths[1])
    return paths


def _plot_pareto(points: list[dict], variable: str, path: str) -> None:
    import matplotlib.pyplot as plt

    throughput = _series(points, "output_throughput")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for key, label, marker in (("ttft_p50_s", "TTFT p50", "o"), ("itl_p50_s", "ITL p50", "s")):
        latency = _series(points, key, 1000)
        ax.scatter(throughput, latency, marker=marker, label=label)
        for x, y, point in zip(throughput, latency, points, strict=True):
            ax.annotate(
                f"{point['variable'][variable]:g}",
                (x, y),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        frontier = pareto_front(list(zip(throughput, latency, strict=True)))
        ax.plot(*zip(*frontier, strict=True), linestyle=":", alpha=0.7)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"latency vs throughput ({variable} labelled)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (throughput, latency) that no other point beats on both, by throughput."""
    front = []
    for x, y in sorted(points, key=lambda p: (-p[0], p[1])):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return sorted(front)


def _series(points: list[dict], key: str, scale: float = 1.0) -> list[float]:
    return [
        float("nan") if p["summary"].get(key) is None else p["summary"][key] * scale for p in points
    ]


def add_sweep_parser(kinds) -> None:
    parser = kinds.add_parser(
        "sweep",
        help="vary one of prompt length, output length, concurrency or rate; table + plots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vary", required=True, choices=VARIABLES, help="the swept variable")
    parser.add_argument("--values", required=True, help="comma list of its values")
    parser.add_argument("--plot", default="sweep", help="plot files: PREFIX.png, PREFIX_pareto.png")
    add_target_args(parser)
    add_workload_args(parser)
    add_run_args(parser, lists=False)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bench.prompt_text import PromptMaker

    if args.concurrency is None and args.rate is None and args.vary not in ("concurrency", "rate"):
        args.concurrency = "4"
    maker = PromptMaker.from_arg(args.tokenizer)
    model = asyncio.run(resolve_model_name(args))
    points = sweep_points(args, model)
    header = build_header("pdserve bench sweep", args.url, model, args.tokenizer, points[0][2])
    header["sweep"] = {"vary": args.vary, "values": args.values}
    entries = asyncio.run(run_points(points, maker, args.repeats))
    if args.json:
        write_json(args.json, header, entries)
    if args.csv:
        write_csv(args.csv, entries)
    paths = plot_sweep(entries, args.vary, args.plot)
    print(format_table(entries))
    print(format_definitions())
    print("wrote " + ", ".join(paths))
    return 0
