"""What a CUDA engine holds besides its KV pool, measured at start-up to size the pool.

Lifecycle (`LLMEngine.__init__` on CUDA, given no block count):
    `DeviceSnapshot.take` before the weights load (the CUDA context already made)
    -> the weights load
    -> `profile_memory`: one forward at the largest step the scheduler can make
       (`max_batch_tokens` of prompt pieces, `prefill_chunk_size` long, over at most
       `max_num_seqs` sequences) into a throwaway pool just big enough for it, its
       peak read from torch's allocator; then, with CUDA graphs on, every decode graph
       captured over the same pool and thrown away, to learn their memory (the graphs
       are captured again over the real pool, which does not exist yet: it is sized
       from these numbers, as vLLM subtracts its graphs' memory)
    -> `engine.kv_sizing.size_kv_pool` with `MemoryProfile.used_bytes`.
Device-wide numbers (`mem_get_info`) are read only for memory that torch's allocator
does not see (the CUDA libraries' workspaces, NCCL): another process starting on the
same GPU at the same moment inflates that part, which errs towards a smaller pool.
Decode steps at long contexts are not profiled (the pool they need is what is being
sized); the share left outside `gpu_memory_utilization` absorbs what they add.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from engine.block_manager import blocks_needed
from engine.kv_cache import KVCachePool, KVLayout
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceSnapshot:
    """The device's memory and this process's allocator at one moment."""

    free_bytes: int
    total_bytes: int
    reserved_bytes: int
    """Held by this process's torch caching allocator."""
    allocated_bytes: int
    """Handed out by it to live tensors."""

    @classmethod
    def take(cls, device: str) -> DeviceSnapshot:
        """Called once before the weights load, and again after profiling."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            free_bytes=free,
            total_bytes=total,
            reserved_bytes=torch.cuda.memory_reserved(device),
            allocated_bytes=torch.cuda.memory_allocated(device),
        )

    @property
    def device_used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


@dataclass(frozen=True)
class MemoryProfile:
    """An engine's memory besides its KV pool, in bytes."""

    weights_bytes: int
    activation_bytes: int
    """Peak of the profiling step above the weights and its throwaway pool."""
    graph_bytes: int
    """What capturing every decode graph added to the allocator's reservation."""
    runtime_bytes: int
    """Device memory taken outside torch's allocator since the snapshot (libraries'
    workspaces, NCCL buffers)."""
    free_bytes: int
    """The device's free memory once profiling released what it held."""

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.graph_bytes + self.runtime_bytes


def profile_step_lengths(
    max_batch_tokens: int, prefill_chunk_size: int, max_num_seqs: int, max_model_len: int
) -> list[int]:
    """Prompt pieces of the largest step the scheduler can make: `max_batch_tokens`
    tokens in pieces of `prefill_chunk_size` (shorter than `max_model_len`), at most
    `max_num_seqs` of them."""
    piece = max(1, min(prefill_chunk_size, max_model_len - 1))
    lengths, left = [], max_batch_tokens
    while left > 0 and len(lengths) < max_num_seqs:
        lengths.append(min(piece, left))
        left -= lengths[-1]
    return lengths


def profile_chunks(lengths: list[int], block_size: int) -> list[ScheduledChunk]:
    """One fresh sequence per piece (token 0 throughout), its blocks numbered in order
    from 0: the step `profile_memory` runs, over a pool of `blocks_needed` blocks per
    piece."""
    chunks, next_block = [], 0
    for index, length in enumerate(lengths):
        count = blocks_needed(length, block_size)
        seq = Sequence(f"memory-profile-{index}", [0] * length, SamplingParams(max_tokens=1))
        seq.block_ids = list(range(next_block, next_block + count))
        next_block += count
        chunks.append(ScheduledChunk(seq, length))
    return chunks


def profile_memory(
    model, layout: KVLayout, config, max_model_len: int, baseline: DeviceSnapshot
) -> MemoryProfile:
    """Measure the engine's memory besides the pool (see the module docstring); `config`
    is its EngineConfig, `baseline` the snapshot taken before the weights loaded."""
    device = config.device
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device) - baseline.allocated_bytes
    lengths = profile_step_lengths(
        config.max_batch_tokens, config.prefill_chunk_size, config.max_num_seqs, max_model_len
    )
    chunks = profile_chunks(lengths, layout.block_size)
    pool = KVCachePool(layout, sum(len(c.seq.block_ids) for c in chunks) + 1, device)
    torch.cuda.reset_peak_memory_stats(device)
    before_step = torch.cuda.memory_allocated(device)
    ModelRunner(model, pool).run(chunks)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before_step
    graphs = _graph_bytes(model, pool, config, max_model_len) if config.cuda_graphs else 0
    del pool, chunks
    gc.collect()
    after = DeviceSnapshot.take(device)
    runtime = (after.device_used_bytes - baseline.device_used_bytes) - (
        after.reserved_bytes - baseline.reserved_bytes
    )
    profile = MemoryProfile(weights, activations, graphs, max(0, runtime), after.free_bytes)
    logger.info(
        "memory profile: weights %.1f MiB, peak of a %d-token step %.1f MiB, decode graphs "
        "%.1f MiB, runtime %.1f MiB",
        weights / 2**20,
        sum(lengths),
        activations / 2**20,
        graphs / 2**20,
        profile.runtime_bytes / 2**20,
    )
    return profile


def _graph_bytes(model, pool: KVCachePool, config, max_model_len: int) -> int:
    """Capture every decode graph over the throwaway pool (its last block the scratch),
    measure what that reserved, and let them go."""
    device = config.device
    before = torch.cuda.memory_reserved(device)
    runner = ModelRunner(
        model,
        pool,
        cuda_graphs=True,
        scratch_block=pool.num_blocks - 1,
        max_model_len=max_model_len,
    )
    runner.capture_graphs(config.max_num_seqs)
    torch.cuda.synchronize(device)
    captured = torch.cuda.memory_reserved(device) - before
    del runner
    gc.collect()
    return max(0, captured)
