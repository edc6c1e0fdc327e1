"""`pdserve bench ...` subcommands."""

from __future__ import annotations

import argparse

from engine.config import KERNEL_CHOICES, KV_CACHE_DTYPES


def add_bench_parser(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    kinds = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    engine = kinds.add_parser(
        "engine",
        help="decode and prefill throughput of the engine vs transformers, same run",
        description="Steady-state decode step at several batch sizes (ours and transformers' "
        "generate, prefill cancelled out), end-to-end batched generation (ours, transformers' "
        "generate and continuous batching, prefill included), prefill tokens/s, and each "
        "decode step against the roofline of read bandwidth measured in the same run.",
    )
    engine.add_argument(
        "--model",
        default="demo",
        help="a local HF model directory, or `demo` (SmolLM2-135M-Instruct, converted once "
        "from its GGUF package) (default: %(default)s)",
    )
    engine.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: float32 on CPUs (exact against transformers; bfloat16 is faster on "
        "AMX CPUs, say so explicitly), bfloat16 on GPUs",
    )
    engine.add_argument(
        "--batch-sizes",
        default="1,4,16,64",
        help="comma-separated decode batch sizes (default: %(default)s)",
    )
    engine.add_argument(
        "--prompt-len",
        type=int,
        default=256,
        help="tokens prefilled per sequence before its decode steps are timed, and per "
        "prompt of the prefill figure (default: %(default)s)",
    )
    engine.add_argument(
        "--decode-steps",
        type=int,
        default=32,
        help="decode steps timed per run (the step figure is their median) and new tokens "
        "of the end-to-end runs (default: %(default)s)",
    )
    engine.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the engine (default: torch's own default, every core)",
    )
    engine.add_argument(
        "--kernels",
        default="auto",
        choices=KERNEL_CHOICES,
        help="layer ops: native float32 CPU kernels, torch, or auto (native where it applies)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV pool dtype (default auto: the model's dtype; float32 under bf16 weights "
        "measures what a full-precision pool costs decode attention)",
    )
    engine.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    engine.add_argument(
        "--pin-threads",
        action="store_true",
        help="every step on --threads threads (default: each step on the count measured "
        "fastest for steps like it, see engine/threads.py)",
    )
    engine.add_argument(
        "--phases",
        action="store_true",
        help="also split each batch size's decode step into its phases (embedding, each "
        "projection, RoPE + KV store, attention, LM head), timed inside the fused native "
        "step: builds the kernels with their phase clock (PDSERVE_KERNEL_PHASE_CLOCK=1). "
        "Each phase is a mean over the timed steps: with --pin-threads, none of them is a "
        "try of another thread count",
    )
    engine.add_argument("--skip-transformers", action="store_true", help="only our engine")
    engine.add_argument("--json", default=None, help="also write results to this JSON file")
    engine.set_defaults(func=_run_engine_bench)
    from bench.bandwidth_sweep import add_bandwidth_parser
    from bench.compare import add_compare_parser
    from bench.compare_servers import add_compare_servers_parser
    from bench.family_bench import add_families_parser
    from bench.gpu_check import add_gpu_check_parser
    from bench.results_report import add_report_parser
    from bench.serve_bench import add_serve_bench_parser
    from bench.step_trace import add_steps_parser
    from bench.sweep import add_sweep_parser
    from bench.tp_bench import add_tp_parser
    from bench.transfer_bench import add_transfer_parser

    add_transfer_parser(kinds)
    add_serve_bench_parser(kinds)
    add_sweep_parser(kinds)
    add_compare_parser(kinds)
    add_compare_servers_parser(kinds)
    add_report_parser(kinds)
    add_steps_parser(kinds)
    add_bandwidth_parser(kinds)
    add_gpu_check_parser(kinds)
    add_tp_parser(kinds)
    add_families_parser(kinds)


def _run_engine_bench(args: argparse.Namespace) -> int:
    from bench.engine_bench import run_engine_bench

    return run_engine_bench(args)
