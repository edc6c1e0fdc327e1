"""`pdserve bench tp`: one worker's forward split over N ranks, against one rank that
uses the same N cores as threads, in one sitting.

Each configuration runs in fresh processes, as a worker's ranks do: `tp=1` is one
process with N torch threads on cores 0..N-1; `tp=N` is N processes, rank r alone on
core r with one thread, joined by gloo over a loopback store (`TPGroup.join`); rank 0
is an `LLMEngine`, the others `FollowerEngine`s running its steps. Rank 0 times

* prefill: tokens/s of `PREFILL_PROMPTS` prompts of `--prompt-len` in one step;
* the batch-1 decode step (median over `--decode-steps`);
* inside each, the seconds its collectives took on rank 0: the forward's all-reduces
  and LM-head gather (`model`), and the step broadcast to the followers (`step`).
  A collective's time includes waiting for the slowest rank, so it is the whole
  price of the split, not only the bytes on the wire;
* one row's all-reduce (the decode step's size) on the bare library (gloo) and through
  the worker's `TPGroup` (a shared-memory segment on a CPU), timed on the same ranks
  before the engines load.

The configurations alternate (`--rounds` of tp=1, tp=N), so a drift of this shared
machine lands on both; every figure printed is the median over rounds.

With `--transfer-prompts` (default 8) it then serves those prompts through two live
1 + 1 clusters, prefill tp=N and prefill tp=1, each into a decode worker of one rank
(`bench/tp_transfer.py`): what resharding costs the transfer, in bytes, head slices
and time, beside the transfer it replaces.

The demo model (9 query heads, 3 KV heads) does not split over 2 ranks. `--model
stand-in` writes (once) random weights of the demo's size with 12 query heads and
4 KV heads of 48 dims: the same parameters, the same KV bytes per token, splittable
over 2 and 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

PREFILL_PROMPTS = 4
"""Prompts of the prefill figure, prefilled together in one step."""
STAND_IN_HEADS = dict(num_attention_heads=12, num_key_value_heads=4, head_dim=48)
"""SmolLM2-135M's 576 hidden as 12 x 48 (its own is 9 x 64) and 4 KV heads of 48
(its own: 3 of 64): the same projections' sizes and KV bytes per token."""


@dataclass
class TPRun:
    """One configuration's figures from one round (rank 0's clock)."""

    tp: int
    threads_per_rank: int
    prefill_tok_s: float
    prefill_model_collective_ms: float
    """Per prefill step: the forward's all-reduces and gather on rank 0."""
    decode_step_ms: float
    decode_model_collective_ms: float
    """Per batch-1 decode step: the forward's all-reduces and gather on rank 0."""
    decode_step_broadcast_ms: float
    """Per batch-1 decode step: rank 0 sending the step to its followers."""
    decode_collectives_per_step: int
    """All-reduces and gathers in one batch-1 decode step (2 per layer, 1 gather)."""
    bare_all_reduce_us: float
    """One row's all-reduce on the bare library (gloo), timed on the same ranks before
    the engines load (0 at tp=1)."""
    group_all_reduce_us: float
    """The same through the worker's `TPGroup` (shared memory on a CPU)."""


@dataclass
class TPBenchResult:
    model: str
    cpu: str
    tp: int
    prompt_len: int
    decode_steps: int
    runs: list[TPRun] = field(default_factory=list)
    transfers: list = field(default_factory=list)
    """`bench.tp_transfer.TransferRun`s: prefill tp=N, then tp=1, into decode tp=1."""

    def median(self, tp: int, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.runs if r.tp == tp)


def add_tp_parser(kinds) -> None:
    """Called by `bench.cli.add_bench_parser`."""
    parser = kinds.add_parser(
        "tp",
        help="tensor parallelism on this CPU: tp=N (one core per rank) vs tp=1 (N threads)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="stand-in",
        help="`stand-in` (the demo's size, heads that split: see above), `demo`, or a "
        "local HF directory (default: %(default)s)",
    )
    parser.add_argument("--tp", type=int, default=2, help="ranks of the split (default 2)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--decode-steps", type=int, default=32, help="batch-1 steps timed")
    parser.add_argument("--rounds", type=int, default=3, help="tp=1, tp=N alternations")
    parser.add_argument(
        "--transfer-prompts",
        type=int,
        default=8,
        help="prompts of `--prompt-len` through prefill tp=N and tp=1 clusters into a "
        "decode tp=1 worker, to time the resharded transfer (0 skips; default 8)",
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.set_defaults(func=run_tp_bench)


def run_tp_bench(args: argparse.Namespace) -> int:
    from bench.hardware import cpu_model

    model = _model_path(args.model)
    refusal = _split_refusal(model, args.tp)
    if refusal:
        print(f"pdserve bench tp: {refusal}")
        return 2
    result = TPBenchResult(model, cpu_model(), args.tp, args.prompt_len, args.decode_steps)
    for round_ in range(args.rounds):
        for tp in (1, args.tp):
            run = _run_configuration(model, tp, args)
            print(f"round {round_ + 1}/{args.rounds} tp={tp}: {_one_line(run)}", flush=True)
            result.runs.append(run)
    print(format_report(result))
    if args.transfer_prompts > 0:
        from bench.tp_transfer import format_transfer_report, measure_resharding

        result.transfers = measure_resharding(
            model, args.tp, args.prompt_len, args.transfer_prompts
        )
        print(format_transfer_report(result.transfers, args.prompt_len, args.transfer_prompts))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=2))
    return 0


def _model_path(model: str) -> str:
    if model != "stand-in":
        return model
    from bench.stand_in_model import write_stand_in_model
    from engine.demo_model import demo_model_dir

    directory = demo_model_dir().parent / "smollm2-135m-shape-12x48-heads"
    return str(write_stand_in_model(directory, **STAND_IN_HEADS))


def _split_refusal(model: str, tp: int) -> str | None:
    from engine.demo_model import resolve_model
    from engine.model_spec import load_model_spec
    from engine.parallel.shard import ModelShard, TPSplitError

    model_dir, model_id = resolve_model(model)
    try:
        ModelShard.of(load_model_spec(model_dir, model_id), tp, 0)
    except TPSplitError as exc:
        return f"{exc} (`--model stand-in` is the demo's size with heads that split)"
    return None


def _run_configuration(model: str, tp: int, args) -> TPRun:
    """tp=1: one process on `args.tp` cores; else `tp` processes of one core each."""
    from bench.tp_ranks import rank_main

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    threads = args.tp if tp == 1 else 1
    ranks = [
        context.Process(
            target=rank_main,
            args=(rank, tp, threads, port, model, args.prompt_len, args.decode_steps, results),
        )
        for rank in range(tp)
    ]
    for process in ranks:
        process.start()
    try:
        outcome = results.get(timeout=900)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    if isinstance(outcome, str):
        raise RuntimeError(f"tp={tp} failed: {outcome}")
    return TPRun(**outcome)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _one_line(run: TPRun) -> str:
    return (
        f"prefill {run.prefill_tok_s:.0f} tok/s, decode step {run.decode_step_ms:.2f} ms "
        f"(collectives {run.decode_model_collective_ms:.2f} ms + step broadcast "
        f"{run.decode_step_broadcast_ms:.2f} ms)"
    )


def format_report(result: TPBenchResult) -> str:
    """The side-by-side table of medians over rounds, with the CPU named."""
    n = result.tp
    rows = [
        ("prefill tok/s", "prefill_tok_s", "{:.0f}"),
        ("  of which collectives, ms/step", "prefill_model_collective_ms", "{:.1f}"),
        ("batch-1 decode step, ms", "decode_step_ms", "{:.2f}"),
        ("  of which collectives, ms", "decode_model_collective_ms", "{:.2f}"),
        ("  of which step broadcast, ms", "decode_step_broadcast_ms", "{:.2f}"),
        ("collectives per decode step", "decode_collectives_per_step", "{:.0f}"),
        ("one row's all-reduce, gloo, us", "bare_all_reduce_us", "{:.0f}"),
        ("one row's all-reduce, TPGroup, us", "group_all_reduce_us", "{:.0f}"),
    ]
    lines = [
        f"model {result.model}, float32, {PREFILL_PROMPTS} x {result.prompt_len}-token "
        f"prompts; CPU {result.cpu}; medians of {len(result.runs) // 2} rounds",
        f"{'':34} {'tp=1 x ' + str(n) + ' threads':>18} {'tp=' + str(n) + ' x 1 thread':>18}",
    ]
    for label, name, form in rows:
        one, split = result.median(1, name), result.median(n, name)
        lines.append(f"{label:34} {form.format(one):>18} {form.format(split):>18}")
    return "\n".join(lines)
