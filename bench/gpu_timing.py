"""Engine step times on a GPU, for `bench/gpu_check.py`: the batch-1 decode step against
the roofline of the GPU's memory bandwidth, and each CUDA attention backend on the same
decode and prefill steps.

A step's time is the wall time of `LLMEngine.step()` (the engine reads its sampled
tokens back, so the GPU has finished the step when it returns); a figure is the median
of many. Decode steps are timed once every sequence is past its prompt, with CUDA
graphs on, as a server runs them.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from bench.hardware import hardware_profile
from bench.roofline import decode_step
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

BACKENDS = ("triton", "flashinfer", "flash_attn")
"""The CUDA paged-attention backends compared; the torch gather path is the reference
in tests/test_gpu.py, not a contender."""


def gpu_engine(model: str, **settings) -> LLMEngine:
    """bf16 on the GPU, its KV pool sized from `gpu_memory_utilization` unless a count
    is given (the sizing logs what it chose)."""
    config = dict(model=model, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    config.update(settings)
    return LLMEngine(EngineConfig(**config))


def release(engine: LLMEngine) -> None:
    """Give the engine's device memory back before the next one (or a server) starts."""
    for request_id in list(engine.sequences):
        engine.abort(request_id)
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def decode_step_s(engine: LLMEngine, batch: int, context: int, steps: int = 64) -> float:
    """Median decode step of `batch` sequences whose prompts are `context` tokens."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    vocab = engine.spec.vocab_size
    for i in range(batch):
        prompt = [(7 + 13 * i + 31 * j) % (vocab - 2) + 2 for j in range(context)]
        engine.add_request(f"decode-{batch}-{context}-{i}", prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()
    for _ in range(4):  # the first replays of each graph
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(engine.sequences):
        engine.abort(request_id)
    return statistics.median(times)


def prefill_step_s(engine: LLMEngine, prompts: int, length: int, repeats: int = 7) -> float:
    """Median time of one step that prefills `prompts` prompts of `length` tokens (the
    engine's `max_batch_tokens` must hold them all)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab, times = engine.spec.vocab_size, []
    for repeat in range(repeats + 1):
        for i in range(prompts):
            prompt = [(repeat * 101 + i * 17 + j) % (vocab - 2) + 2 for j in range(length)]
            engine.add_request(f"prefill-{repeat}-{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        if repeat:  # the first is a warm-up
            times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times)


@dataclass(frozen=True)
class RooflinePoint:
    measured_s: float
    bound_s: float
    bytes_moved: float
    hardware: str
    bandwidth_bytes_per_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.bound_s

    def describe(self) -> str:
        return (
            f"batch-1 decode step {self.measured_s * 1e3:.3f} ms; {self.hardware} roofline "
            f"{self.bound_s * 1e3:.3f} ms ({self.bytes_moved / 1e6:.1f} MB at "
            f"{self.bandwidth_bytes_per_s / 1e12:.2f} TB/s): {self.ratio:.1f}x the bound"
        )


def decode_against_roofline(model: str, hardware: str, context: int = 256) -> RooflinePoint:
    """The batch-1 decode step (auto backend, CUDA graphs) and its lower bound: weights
    plus KV streamed once at `hardware`'s memory bandwidth (`pdserve roofline`)."""
    engine = gpu_engine(model, max_num_seqs=16)
    try:
        measured = decode_step_s(engine, batch=1, context=context)
        profile = hardware_profile(hardware)
        bound = decode_step(engine.spec, profile, batch=1, context=context + 32, dtype="bfloat16")
    finally:
        release(engine)
    return RooflinePoint(
        measured, bound.lower_bound_s, bound.bytes_moved, profile.name, profile.memory_bandwidth
    )


def compare_backends(model: str, available: list[str]) -> list[dict]:
    """Each available backend on a decode step (batch 16, 1024-token contexts) and a
    prefill step (4 prompts of 512): one row per backend, with the backend the engine
    actually ran (a library that cannot serve a shape hands it to Triton)."""
    rows = []
    for name in available:
        engine = gpu_engine(model, attention_backend=name, max_num_seqs=16, max_batch_tokens=2048)
        try:
            rows.append(
                {
                    "backend": name,
                    "ran": engine.model.attention.name,
                    "decode_b16_c1024_ms": decode_step_s(engine, 16, 1024, steps=32) * 1e3,
                    "prefill_4x512_ms": prefill_step_s(engine, 4, 512) * 1e3,
                }
            )
        finally:
            release(engine)
    return rows
