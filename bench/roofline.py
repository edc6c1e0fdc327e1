"""`pdserve roofline`: which resource bounds a prefill or decode step, and how fast it could be.

One forward step is counted as FLOPs and bytes moved:

- FLOPs: 2 x weights for every new token through the projections; the LM head for every
  row that samples (all rows in decode, the last row of each prompt in prefill); causal
  attention, 4 x heads x head_dim per (query, key) pair.
- bytes: the weights streamed once per step, the KV cache read (the tokens already
  cached) and written (the new tokens). Activations, kernel launches and communication
  are not counted, so the step time is a lower bound.

Arithmetic intensity = FLOPs / bytes. The ridge point = peak FLOP/s / bandwidth. Below
the ridge the step is memory-bound, above it compute-bound; the lower-bound step time
is max(FLOPs / peak, bytes / bandwidth).

Public API (also used by `pdserve bench engine` to put its measured step times next to
this bound on the same machine):

    from bench.roofline import hardware_profile, decode_step, prefill_step, roofline
    from bench.model_shape import load_shape          # or pass the engine's ModelSpec

    hw = hardware_profile("cpu", dtypes=("float32",))   # measured now; or "h100", ...
    step = decode_step(model, hw, batch=16, context=288, dtype="float32")
    step.lower_bound_s, step.bound, step.intensity, step.ridge   # StepRoofline fields
    roofline(model, hw, batch=1, context=256, prompt=256, dtype="bfloat16")  # both phases

`model` is anything with ModelShape's fields (num_layers, hidden_size,
intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size); the engine's
`ModelSpec` has them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from bench.hardware import HARDWARE_NAMES, HardwareProfile, hardware_profile
from bench.kv_calc import kv_bytes_per_token
from bench.model_shape import (
    DTYPE_BYTES,
    active_linear_params,
    lm_head_params,
    load_shape,
    streamed_weight_params,
)

__all__ = ["StepRoofline", "decode_step", "hardware_profile", "prefill_step", "roofline"]

BOUND_NOTE = (
    "Lower bound: weights and KV reads/writes only; activations, kernel launches, "
    "communication and attention inefficiency are not counted."
)


@dataclass(frozen=True)
class StepRoofline:
    """One forward step of `batch` sequences, each adding `new_tokens` after `cached` ones."""

    phase: str
    hardware: str
    dtype: str
    batch: int
    cached: int
    new_tokens: int
    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    intensity: float
    """FLOPs per byte moved."""
    ridge: float
    """FLOPs per byte where compute and memory time are equal on this hardware."""
    bound: str
    """'memory' or 'compute'."""
    compute_s: float
    memory_s: float
    lower_bound_s: float

    @property
    def bytes_moved(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second at the lower-bound step time (an upper bound on speed)."""
        return self.batch * self.new_tokens / self.lower_bound_s


def attention_flops(model, cached: int, new_tokens: int) -> float:
    """QK^T and AV for `new_tokens` causal queries over `cached` + the preceding new keys."""
    pairs = new_tokens * cached + new_tokens * (new_tokens + 1) / 2
    return 4 * model.num_heads * model.head_dim * pairs * model.num_layers


def step_roofline(
    model,
    hardware: HardwareProfile,
    phase: str,
    batch: int,
    cached: int,
    new_tokens: int,
    dtype: str,
    kv_dtype: str | None = None,
) -> StepRoofline:
    if batch <= 0 or new_tokens <= 0 or cached < 0:
        raise ValueError("batch and new tokens must be positive, cached tokens not negative")
    sampled_rows = batch  # one logits row per sequence: every decode row, each prompt's last
    tokens = batch * new_tokens
    flops = (
        2 * active_linear_params(model) * tokens
        + 2 * lm_head_params(model) * sampled_rows
        + batch * attention_flops(model, cached, new_tokens)
    )
    kv_token = kv_bytes_per_token(model, kv_dtype or dtype)
    weight_bytes = streamed_weight_params(model, tokens) * DTYPE_BYTES[dtype]
    kv_read, kv_write = batch * cached * kv_token, tokens * kv_token
    bytes_moved = weight_bytes + kv_read + kv_write
    compute_s = flops / hardware.flops(dtype)
    memory_s = bytes_moved / hardware.memory_bandwidth
    intensity, ridge = flops / bytes_moved, hardware.ridge(dtype)
    return StepRoofline(
        phase=phase,
        hardware=hardware.name,
        dtype=dtype,
        batch=batch,
        cached=cached,
        new_tokens=new_tokens,
        flops=flops,
        weight_bytes=weight_bytes,
        kv_read_bytes=kv_read,
        kv_write_bytes=kv_write,
        intensity=intensity,
        ridge=ridge,
        bound="compute" if intensity >= ridge else "memory",
        compute_s=compute_s,
        memory_s=memory_s,
        lower_bound_s=max(compute_s, memory_s),
    )


def decode_step(model, hardware, batch: int, context: int, dtype: str, kv_dtype=None):
    """One decode step: `batch` sequences, each with `context` tokens cached, one new token."""
    return step_roofline(model, hardware, "decode", batch, context, 1, dtype, kv_dtype)


def prefill_step(model, hardware, batch: int, prompt: int, dtype: str, cached: int = 0):
    """One prefill step: `batch` prompts of `prompt` tokens (after `cached` prefix tokens)."""
    return step_roofline(model, hardware, "prefill", batch, cached, prompt, dtype)


def roofline(
    model, hardware, batch: int = 1, context: int | None = None, prompt: int = 256, dtype="bfloat16"
) -> dict[str, StepRoofline]:
    """Both phases: prefill of `batch` prompts, then a decode step at `context` (default: prompt)."""
    return {
        "prefill": prefill_step(model, hardware, batch, prompt, dtype),
        "decode": decode_step(
            model, hardware, batch, prompt if context is None else context, dtype
        ),
    }


def format_roofline(model_name: str, hardware: HardwareProfile, steps: dict) -> str:
    dtype = next(iter(steps.values())).dtype
    flops, bandwidth = hardware.flops(dtype), hardware.memory_bandwidth
    lines = [
        f"{model_name} on {hardware.name} ({dtype}); {hardware.source}",
        f"peak {flops / 1e12:,.4g} TFLOP/s, memory {bandwidth / 1e9:,.1f} GB/s -> "
        f"ridge {hardware.ridge(dtype):.1f} FLOP/byte",
        "",
        f"{'phase':<8}{'batch':>6}{'cached':>8}{'new':>6}{'GFLOP':>12}{'weights MB':>11}"
        f"{'KV rd MB':>10}{'KV wr MB':>10}{'FLOP/B':>9}  {'bound':<8}{'compute ms':>11}"
        f"{'memory ms':>10}{'step >= ms':>11}{'tok/s <=':>10}",
    ]
    for s in steps.values():
        lines.append(
            f"{s.phase:<8}{s.batch:>6}{s.cached:>8}{s.new_tokens:>6}{s.flops / 1e9:>12.2f}"
            f"{s.weight_bytes / 1e6:>11.1f}{s.kv_read_bytes / 1e6:>10.1f}"
            f"{s.kv_write_bytes / 1e6:>10.1f}{s.intensity:>9.1f}  {s.bound:<8}"
            f"{s.compute_s * 1e3:>11.4g}{s.memory_s * 1e3:>10.4g}{s.lower_bound_s * 1e3:>11.4g}"
            f"{s.tokens_per_s:>10.0f}"
        )
    return "\n".join([*lines, "", BOUND_NOTE])


def add_roofline_parser(sub) -> None:
    """Registered as the top-level `pdserve roofline` by cluster/cli/main.py."""
    parser = sub.add_parser(
        "roofline",
        help="arithmetic intensity, ridge point, bound and lower-bound step time of prefill/decode",
        description=__doc__.split("Public API")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="demo", help="'demo' or a local HF model directory")
    source.add_argument("--config", default=None, help="a HF config.json file instead of a model")
    parser.add_argument(
        "--hardware",
        default="h100",
        choices=HARDWARE_NAMES,
        help="a datasheet profile, or 'cpu': bandwidth and matmul FLOP/s measured now",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_BYTES],
        help="weights/KV dtype (auto: bfloat16 on accelerators, float32 on cpu)",
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences in the step")
    parser.add_argument(
        "--context", type=int, default=None, help="tokens cached per sequence at decode"
    )
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per prefill")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for 'cpu'")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    model = load_shape(args.model, args.config)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if args.hardware == "cpu" else "bfloat16"
    hardware = hardware_profile(args.hardware, dtypes=(dtype,), threads=args.threads)
    steps = roofline(model, hardware, args.batch, args.context, args.prompt, dtype)
    if args.json:
        report = {
            "model": model.name,
            "hardware": asdict(hardware),
            **{phase: {**asdict(s), "tokens_per_s": s.tokens_per_s} for phase, s in steps.items()},
        }
        print(json.dumps(report, indent=2))
    else:
        print(format_roofline(model.name, hardware, steps))
    return 0
