"""`pdserve bench steps`: what each worker's engine computed, step by step.

Reads `/admin/steps` (each worker's last engine steps: start on the worker's clock,
duration, decode sequences, prefill sequences and tokens) and prints, per worker, a
summary (steps, busy share of the traced span, decode batch sizes, prefill tokens per
step) and optionally a PNG: decode batch size and prefill tokens per step over time,
one row per worker. It shows how a server schedules a given load: batches that swing
between full and empty, prefill steps that hold decode back, idle gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from bench.loadgen import get_json


def summarize_worker(steps: list[dict]) -> dict:
    if not steps:
        return {"steps": 0}
    span = steps[-1]["started"] + steps[-1]["seconds"] - steps[0]["started"]
    decode = [s["decode_seqs"] for s in steps if s["decode_seqs"]]
    prefill = [s["prefill_tokens"] for s in steps if s["prefill_tokens"]]
    return {
        "steps": len(steps),
        "span_s": round(span, 2),
        "busy_share": round(sum(s["seconds"] for s in steps) / span, 3) if span > 0 else None,
        "decode_batch_median": statistics.median(decode) if decode else 0,
        "decode_batch_max": max(decode, default=0),
        "prefill_tokens_per_step_median": statistics.median(prefill) if prefill else 0,
        "step_ms_median": round(1000 * statistics.median(s["seconds"] for s in steps), 1),
    }


def plot(traces: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [w for w, steps in sorted(traces.items()) if steps]
    fig, axes = plt.subplots(len(workers), 1, sharex=False, figsize=(10, 2.4 * len(workers)))
    for axis, worker in zip([axes] if len(workers) == 1 else axes, workers, strict=True):
        steps = traces[worker]
        t0 = steps[0]["started"]
        times = [s["started"] - t0 for s in steps]
        axis.step(times, [s["decode_seqs"] for s in steps], where="post", label="decode seqs")
        twin = axis.twinx()
        twin.bar(times, [s["prefill_tokens"] for s in steps], width=[s["seconds"] for s in steps],
                 align="edge", alpha=0.3, color="tab:orange", label="prefill tokens")  # fmt: skip
        axis.set_ylabel(f"{worker}\ndecode seqs")
        twin.set_ylabel("prefill tokens")
    fig.supxlabel("seconds (each worker's own clock, from its first traced step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_steps_parser(kinds) -> None:
    parser = kinds.add_parser(
        "steps",
        help="each worker's recent engine steps: batch sizes, prefill tokens, busy share",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the pdserve server")
    parser.add_argument("--api-key", default=None, help="bearer key, when the server has one")
    parser.add_argument("--last", type=int, default=512, help="steps per worker (at most 4096)")
    parser.add_argument("--plot", default=None, help="write a PNG of the steps here")
    parser.add_argument("--json", default=None, help="write the raw steps here")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    traces = asyncio.run(
        get_json(args.url.rstrip("/"), f"/admin/steps?last={args.last}", args.api_key)
    )
    for worker, steps in sorted(traces.items()):
        print(worker, summarize_worker(steps))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(traces, handle)
    if args.plot:
        plot(traces, args.plot)
        print(f"plot: {args.plot}")
    return 0
