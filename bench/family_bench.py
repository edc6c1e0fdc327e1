"""`pdserve bench families`: `pdserve bench engine` on one small model of each family
the engine serves, so that their speeds (ours and transformers', same run) sit in one
table.

Each model is random bfloat16 weights of one shape shared as far as each family
allows (`FAMILY_SHAPE`: 8 layers, hidden 512, 8 query heads and 2 KV heads of 64,
vocabulary 8192), built from the family's transformers config with what sets it apart
turned on: q/k norms (Qwen3), q/k/v biases (Qwen2), soft-capping and sliding layers
(Gemma 2 and 3), fused projections (Phi-3), a sliding window shorter than the prompt
(Mistral), 8 experts of which 2 per token (Mixtral, Qwen3-MoE). They are written once
under the demo model's cache directory. Every family runs in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILY_SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
WINDOW = 128
"""The sliding windows: half the default prompt, so blocks fall out of them."""
FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral_window",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
)


def family_config(family: str):
    """The transformers config of `family` at `FAMILY_SHAPE`."""
    import transformers as tf

    shape = dict(FAMILY_SHAPE)
    if family == "llama":
        return tf.LlamaConfig(**shape)
    if family == "qwen2":
        return tf.Qwen2Config(use_sliding_window=False, **shape)
    if family == "qwen3":
        return tf.Qwen3Config(use_sliding_window=False, **shape)
    if family == "mistral_window":
        return tf.MistralConfig(sliding_window=WINDOW, **shape)
    if family in ("gemma2", "gemma3"):
        gemma = dict(shape, tie_word_embeddings=True, pad_token_id=0)
        gemma.update(query_pre_attn_scalar=64, sliding_window=WINDOW)
        if family == "gemma2":
            return tf.Gemma2Config(
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **gemma
            )
        pattern = ["sliding_attention"] * 3 + ["full_attention"]
        return tf.Gemma3TextConfig(layer_types=pattern * 2, **gemma)
    if family == "phi3":
        del shape["head_dim"]  # Phi-3 derives it: 512 / 8
        return tf.Phi3Config(pad_token_id=0, **shape)
    if family == "mixtral":
        experts = dict(shape, intermediate_size=512)
        return tf.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **experts)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, **shape
        )
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def family_model(family: str) -> Path:
    """The directory of `family`'s model, written on first use."""
    from bench.stand_in_model import write_random_model
    from engine.demo_model import demo_model_dir

    directory = demo_model_dir().parent / "bench-families" / family
    what = f"random weights, {family} at bench/family_bench.py's FAMILY_SHAPE"
    return write_random_model(directory, family_config(family), what)


def add_families_parser(kinds) -> None:
    """Called by `bench.cli.add_bench_parser`."""
    parser = kinds.add_parser(
        "families",
        help="the engine benchmark on one small model of each served family",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated (default: all)"
    )
    parser.add_argument("--batch-sizes", default="1,8", help="decode batches (default 1,8)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--decode-steps", type=int, default=16, help="steps per decode run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per figure (median)")
    parser.add_argument("--json", default=None, help="also write every family's results")
    parser.set_defaults(func=run_family_bench)


def run_family_bench(args: argparse.Namespace) -> int:
    families = [f for f in args.families.split(",") if f]
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for index, family in enumerate(families, 1):
            print(f"[{index}/{len(families)}] {family}", flush=True)
            out = Path(scratch) / f"{family}.json"
            command = [
                sys.executable, "-m", "cluster.cli", "bench", "engine",
                "--model", str(family_model(family)), "--dtype", "float32",
                "--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len),
                "--decode-steps", str(args.decode_steps), "--repeats", str(args.repeats),
                "--json", str(out),
            ]  # fmt: skip
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            results[family] = json.loads(out.read_text())
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def format_table(results: dict[str, dict]) -> str:
    """A markdown table: per family, ours against transformers at each decode batch,
    and our prefill tokens/s."""
    batches = sorted({int(b) for r in results.values() for b in r["ours_step_ms"]})
    head = ["family", "kernels"]
    for batch in batches:
        head += [f"step b={batch} ours ms", f"b={batch} transformers ms"]
    head.append("prefill tok/s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, result in results.items():
        row = [family, result["kernels"]]
        for batch in batches:
            row += [_ms(result["ours_step_ms"], batch), _ms(result["hf_step_ms"], batch)]
        row.append(f"{result['ours_prefill_tok_s']:.0f}")
        lines.append("| " + " | ".join(row) + " |")
    first = next(iter(results.values()), None)
    if first:
        lines.append(f"\nCPU {first['cpu']}, {first['threads']} threads, {first['dtype']}")
    return "\n".join(lines)


def _ms(by_batch: dict, batch: int) -> str:
    value = by_batch.get(str(batch), by_batch.get(batch))
    return "-" if value is None else f"{value:.2f}"
