"""`pdserve kv-calc`: how much KV cache a model needs and how much fits next to its weights.

The arithmetic, per device under tensor parallelism (KV heads are split across ranks;
with fewer KV heads than ranks each rank keeps one):

    KV bytes per token   = 2 (K and V) x layers x KV heads per rank x head_dim x dtype bytes
                           (multi-head latent attention: layers x latent x dtype bytes,
                           the latent kv_lora_rank + qk_rope_head_dim, on every rank)
    KV bytes per block   = per token x block size
    KV bytes per request = blocks held for `context` tokens x per block: all of them
                           (rounded up), or, when every layer slides, the most a
                           sequence holds at once, since blocks behind every layer's
                           window are freed (a block holds all layers, so one global
                           layer, as in Gemma, keeps every block)
    KV budget            = device memory x utilization - weights per rank
    fit                  = whole blocks in the budget -> tokens, and requests of `context`

This predicts capacity under the stated assumptions (activations, CUDA graphs and
fragmentation live in the 1 - utilization headroom), not speed: two setups with the
same footprint can run at very different tokens per second.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass

from bench.model_shape import DTYPE_BYTES, all_layers_slide, load_shape, total_params

CAPACITY_NOTE = (
    "This predicts memory capacity, not speed: tokens per second depend on compute shape, "
    "kernels and communication, which the KV footprint does not tell."
)
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 8e10, '24G' -> 24 GiB, '1024' -> 1024."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read a size from {text!r} (examples: 80GiB, 24GB, 512MiB)")
    number, prefix, binary = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    base = 1000 if (prefix and not binary and text.strip().upper().endswith("B")) else 1024
    return int(float(number) * base**power)


def kv_heads_per_rank(model, tp: int) -> int:
    return max(1, math.ceil(model.num_kv_heads / tp))


def kv_bytes_per_token(model, dtype: str, tp: int = 1) -> int:
    """K and V of one token across all layers, on one tensor-parallel rank (or the
    latent of multi-head latent attention, which every rank holds whole)."""
    latent = getattr(model, "kv_latent_dim", 0)
    if latent:
        return model.num_layers * latent * DTYPE_BYTES[dtype]
    return 2 * model.num_layers * kv_heads_per_rank(model, tp) * model.head_dim * DTYPE_BYTES[dtype]


def blocks_held_per_request(model, context: int, block_size: int) -> int:
    """The most blocks one sequence of `context` tokens holds at once, as the engine
    frees them (engine/sliding_window.py): all of them unless every layer slides."""
    window = all_layers_slide(model)
    if window is None:
        return math.ceil(context / block_size)

    def held(tokens: int) -> int:
        dead = max(0, tokens - window + 1) // block_size
        return math.ceil(tokens / block_size) - dead

    # Past the window the count repeats every block; scanning one block past it covers all.
    return max(held(n) for n in range(1, min(context, window + block_size) + 1))


@dataclass(frozen=True)
class KvCapacity:
    model: str
    dtype: str
    kv_dtype: str
    tp: int
    block_size: int
    context: int
    device_memory_bytes: int
    memory_utilization: float
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    blocks_per_request: int
    kv_bytes_per_request: int
    sliding_window: int | None
    """The window every layer slides by, which caps the blocks a request holds; None
    when some layer attends to everything."""
    weight_params: int
    weight_bytes_per_rank: int
    kv_budget_bytes: int
    kv_blocks_fit: int
    kv_tokens_fit: int
    requests_fit: int
    note: str = CAPACITY_NOTE


def kv_capacity(
    model,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    block_size: int = 16,
    device_memory: int = 80 << 30,
    memory_utilization: float = 0.9,
    tp: int = 1,
    context: int = 4096,
) -> KvCapacity:
    """The whole calculation; `model` is a ModelShape (or the engine's ModelSpec)."""
    kv_dtype = kv_dtype or dtype
    if block_size <= 0 or tp <= 0 or context <= 0 or not 0 < memory_utilization <= 1:
        raise ValueError("block size, tp and context must be positive; utilization in (0, 1]")
    per_token = kv_bytes_per_token(model, kv_dtype, tp)
    per_block = per_token * block_size
    blocks_per_request = blocks_held_per_request(model, context, block_size)
    params = total_params(model)
    weights = math.ceil(params * DTYPE_BYTES[dtype] / tp)
    budget = max(0, int(device_memory * memory_utilization) - weights)
    blocks = budget // per_block
    return KvCapacity(
        model=model.name,
        dtype=dtype,
        kv_dtype=kv_dtype,
        tp=tp,
        block_size=block_size,
        context=context,
        device_memory_bytes=device_memory,
        memory_utilization=memory_utilization,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        blocks_per_request=blocks_per_request,
        kv_bytes_per_request=blocks_per_request * per_block,
        sliding_window=all_layers_slide(model),
        weight_params=params,
        weight_bytes_per_rank=weights,
        kv_budget_bytes=budget,
        kv_blocks_fit=blocks,
        kv_tokens_fit=blocks * block_size,
        requests_fit=blocks // blocks_per_request,
    )


def human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    return str(value)


def format_capacity(c: KvCapacity) -> str:
    rows = [
        ("model", f"{c.model} (weights {c.dtype}, KV {c.kv_dtype}, tp {c.tp})"),
        ("KV per token", f"{c.kv_bytes_per_token:,} bytes ({human_bytes(c.kv_bytes_per_token)})"),
        ("KV per block", f"{c.kv_bytes_per_block:,} bytes ({c.block_size} tokens)"),
        (
            f"KV per request of {c.context:,} tokens",
            f"{human_bytes(c.kv_bytes_per_request)} ({c.blocks_per_request} blocks"
            + (f", window {c.sliding_window:,})" if c.sliding_window else ")"),
        ),
        (
            "weights per rank",
            f"{human_bytes(c.weight_bytes_per_rank)} ({c.weight_params:,} params)",
        ),
        (
            "KV budget",
            f"{human_bytes(c.kv_budget_bytes)} = {human_bytes(c.device_memory_bytes)} x "
            f"{c.memory_utilization:g} - weights",
        ),
        ("tokens that fit", f"{c.kv_tokens_fit:,} ({c.kv_blocks_fit:,} blocks)"),
        (f"concurrent requests of {c.context:,}", f"{c.requests_fit:,}"),
    ]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{name:<{width}}{value}" for name, value in rows]
    return "\n".join([*lines, "", c.note])


def add_kv_calc_parser(sub) -> None:
    """Registered as the top-level `pdserve kv-calc` by cluster/cli/main.py."""
    parser = sub.add_parser(
        "kv-calc",
        help="KV cache bytes per token/block/request and how many fit next to the weights",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model", default="demo", help="'demo' or a local HF model directory (only config.json)"
    )
    source.add_argument("--config", default=None, help="a HF config.json file instead of a model")
    choices = sorted(DTYPE_BYTES)
    parser.add_argument("--dtype", default="bfloat16", choices=choices, help="weights dtype")
    parser.add_argument(
        "--kv-dtype", default=None, choices=choices, help="KV cache dtype (default: --dtype)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--gpu-memory", default="80GiB", help="memory of one device (80GiB, 24GB, ...)"
    )
    parser.add_argument(
        "--memory-utilization",
        type=float,
        default=0.9,
        help="share of device memory for weights + KV; the rest is headroom for activations",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (KV heads split)")
    parser.add_argument("--context", type=int, default=4096, help="tokens per request")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    model = load_shape(args.model, args.config)
    capacity = kv_capacity(
        model,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        device_memory=parse_bytes(args.gpu_memory),
        memory_utilization=args.memory_utilization,
        tp=args.tp,
        context=args.context,
    )
    print(json.dumps(asdict(capacity), indent=2) if args.json else format_capacity(capacity))
    return 0
