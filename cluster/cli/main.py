"""The `pdserve` command line.

pdserve generate   one generation in this process (no Ray), streamed to stdout
pdserve model      prepare the demo model cache
pdserve bench      benchmarks (engine, serve, sweep, compare, ...)
pdserve kv-calc    KV cache capacity next to the weights
pdserve roofline   arithmetic intensity and lower-bound step time of prefill/decode
"""

from __future__ import annotations

import argparse
import logging
import sys

from cluster import package_version


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' (SmolLM2-135M-Instruct, converted once from the packaged GGUF) "
        "or a local HF model directory (config.json + safetensors)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="weights and KV dtype (auto: bfloat16 or float16 on GPUs, float32 on CPUs, exact against transformers)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )


def _generate_parser(sub) -> None:
    parser = sub.add_parser(
        "generate",
        help="run one generation in this process and stream it to stdout",
        description="Load the model in this process (no Ray, no server), run one prompt, "
        "and stream the text to stdout as tokens are made.",
    )
    _add_model_args(parser)
    from cluster.config_flags import add_config_flags
    from engine.config import ModelSettings

    # The engine's own knobs, as `serve` takes them (--attention-backend, --block-size,
    # --prefill-chunk-size, ...): derived from the config, declared once.
    add_config_flags(parser, ModelSettings, skip={"model", "dtype"})
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, default=None, help="same seed, same output")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from cluster.config_flags import config_overrides
    from engine.config import EngineConfig, ModelSettings
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    try:
        config = EngineConfig(**config_overrides(args, ModelSettings), num_threads=args.threads)
        engine = LLMEngine(config)
    except ValueError as exc:  # a setting this machine cannot run, e.g. triton on a CPU
        raise SystemExit(f"pdserve generate: {exc}") from None
    if args.chat:
        prompt_ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}]
        )
    else:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    engine.add_request("generate-0", prompt_ids, params)
    while engine.has_unfinished():
        for output in engine.step():
            sys.stdout.write(output.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _model_parser(sub) -> None:
    parser = sub.add_parser("model", help="manage the demo model cache")
    actions = parser.add_subparsers(dest="action", required=True)
    prepare = actions.add_parser(
        "prepare",
        help="convert the packaged SmolLM2 GGUF to a cached safetensors dir (idempotent)",
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")
    prepare.set_defaults(func=_run_model_prepare)


def _run_model_prepare(args: argparse.Namespace) -> int:
    from engine.demo_model import prepare_demo_model

    print(prepare_demo_model(force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving on Ray.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"pdserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _generate_parser(sub)
    from cluster.cli.serve import add_serve_parser

    add_serve_parser(sub)
    from bench.drill import add_drill_parser

    add_drill_parser(sub)
    _model_parser(sub)
    from bench.cli import add_bench_parser

    add_bench_parser(sub)
    from bench.kv_calc import add_kv_calc_parser
    from bench.roofline import add_roofline_parser

    add_kv_calc_parser(sub)
    add_roofline_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)
