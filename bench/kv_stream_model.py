"""What TTFT a KV link should give, whole-prompt or chunk-streamed: arithmetic, not
measurement. `pdserve bench bandwidth --kv-modes` draws it beside what it measured, and
projects the same curves for GPU clusters (Llama-3-8B and 70B on H100s).

A prompt of `n` tokens prefilled in `k` chunks takes `compute` seconds (chunk i:
`chunk_compute[i]`); its KV takes `transfer` seconds over the link, chunk i's share
`chunk_transfer[i]`. With `first_token_from: decode` the first token waits for the KV:

    whole:    base + compute + transfer
    streamed: base + pipeline finish, each chunk's blocks moving once its step ended and
              the link is free:  done_i = max(end of chunk i, done_{i-1}) + chunk_transfer[i]
              = about max(compute + last chunk's transfer, first chunk's compute + transfer)

`base` is what neither changes: queueing, the calls, the decode worker's first step.
Streaming hides min(compute, transfer) minus one chunk's worth; it cannot help a prompt
of one chunk, whose segment costs what a whole export costs plus its relay.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.hardware import ACCELERATORS, HardwareProfile
from bench.kv_calc import kv_bytes_per_token
from bench.model_shape import ModelShape, shape_from_config
from bench.roofline import prefill_step


def chunk_sizes(prompt: int, chunk: int) -> list[int]:
    """Tokens of each prefill chunk of a `prompt`-token prompt."""
    return [min(chunk, prompt - start) for start in range(0, prompt, chunk)]


def whole_finish(chunk_compute: list[float], chunk_transfer: list[float]) -> float:
    """Seconds from the prefill's start until the KV landed, moved after the last chunk."""
    return sum(chunk_compute) + sum(chunk_transfer)


def streamed_finish(chunk_compute: list[float], chunk_transfer: list[float]) -> float:
    """The same with each chunk's blocks moving as soon as its step ended (one link)."""
    ended = landed = 0.0
    for compute, transfer in zip(chunk_compute, chunk_transfer, strict=True):
        ended += compute
        landed = max(ended, landed) + transfer
    return landed


def spread_by_tokens(total: float, sizes: list[int]) -> list[float]:
    """`total` split over chunks in proportion to their tokens."""
    tokens = sum(sizes)
    return [total * size / tokens for size in sizes]


@dataclass(frozen=True)
class Expected:
    """Expected TTFT (seconds) of one prompt length at one link bandwidth."""

    prompt: int
    bandwidth: float
    """Bytes/s of the link."""
    whole_s: float
    streamed_s: float
    compute_s: float
    transfer_s: float


def expected_ttft(
    prompt: int,
    chunk: int,
    compute_s: float,
    kv_bytes: float,
    bandwidth: float,
    base_s: float = 0.0,
    chunk_compute: list[float] | None = None,
) -> Expected:
    """Whole and streamed TTFT of a prompt whose prefill takes `compute_s` (per chunk
    `chunk_compute`, else in proportion to tokens) and whose KV is `kv_bytes`."""
    sizes = chunk_sizes(prompt, chunk)
    compute = chunk_compute or spread_by_tokens(compute_s, sizes)
    transfer = spread_by_tokens(kv_bytes / bandwidth, sizes)
    return Expected(
        prompt=prompt,
        bandwidth=bandwidth,
        whole_s=base_s + whole_finish(compute, transfer),
        streamed_s=base_s + streamed_finish(compute, transfer),
        compute_s=sum(compute),
        transfer_s=sum(transfer),
    )


# --- GPU projection ---------------------------------------------------------------------

LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
"""Meta-Llama-3-8B's config.json (the fields the shape reads)."""
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672}
LLAMA3_70B.update(num_hidden_layers=80, num_attention_heads=64)

GPU_MODELS: dict[str, tuple[dict, int]] = {
    "Llama-3-8B": (LLAMA3_8B, 1),
    "Llama-3-70B": (LLAMA3_70B, 4),
}
"""Model -> (config, tensor-parallel H100s per worker: 70B's bf16 weights need more than
one 80 GB card)."""
GPU_LINKS_GBIT = (25, 100, 400)
GPU_CHUNK = 512
"""pdserve's default `prefill_chunk_size`."""
MFU = 0.5
"""Share of the roofline's compute peak a prefill step is taken to reach."""


def gpu_chunk_compute(shape: ModelShape, hardware: HardwareProfile, prompt: int, tp: int):
    """Seconds of each prefill chunk: the roofline's lower bound at `MFU`, split over
    `tp` ranks (each computes its shard of every layer)."""
    times, cached = [], 0
    for size in chunk_sizes(prompt, GPU_CHUNK):
        step = prefill_step(shape, hardware, 1, size, "bfloat16", cached=cached)
        times.append(step.lower_bound_s / MFU / tp)
        cached += size
    return times


def gpu_projection(prompts: tuple[int, ...]) -> list[dict]:
    """Projected TTFT (less `base`) for each model, link and prompt, whole vs streamed.
    Each tensor-parallel rank moves its own KV shard over its own link, in parallel."""
    hardware = ACCELERATORS["h100"]
    rows = []
    for name, (config, tp) in GPU_MODELS.items():
        shape = shape_from_config(config, name)
        per_token = kv_bytes_per_token(shape, "bfloat16", tp)
        for gbit in GPU_LINKS_GBIT:
            for prompt in prompts:
                compute = gpu_chunk_compute(shape, hardware, prompt, tp)
                expected = expected_ttft(
                    prompt,
                    GPU_CHUNK,
                    sum(compute),
                    per_token * prompt,
                    gbit * 1e9 / 8,
                    chunk_compute=compute,
                )
                rows.append({"model": name, "tp": tp, "link_gbit": gbit, **expected.__dict__})
    return rows
