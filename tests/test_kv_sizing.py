"""KV pools sized from the device (`gpu_memory_utilization`): the arithmetic and its
refusals on made-up devices, the config's choice between a fixed count and sizing, and
the profiling step run for real on a CPU. The CUDA measurement itself is in
tests/test_gpu.py (`test_kv_pool_sized_within_the_configured_share`)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CPU_KV_BLOCKS, EngineConfig, ModelSettings
from engine.kv_cache import KVCachePool
from engine.kv_sizing import GIB, KVMemoryError, size_kv_pool
from engine.memory_profile import profile_chunks, profile_step_lengths
from engine.model_runner import ModelRunner
from tests.factories import make_engine

H100 = 80 * GIB
DEMO_BLOCK = 368_640
"""SmolLM2-135M in bf16: 30 layers x K,V x 16 tokens x 3 heads x 64 x 2 bytes."""


def test_the_pool_takes_what_the_share_leaves_in_whole_blocks():
    sizing = size_kv_pool(
        H100, 3 * GIB, 0.9, DEMO_BLOCK, block_size=16, max_model_len=8192, scratch_blocks=1
    )
    expected = (int(H100 * 0.9) - 3 * GIB) // DEMO_BLOCK
    assert sizing.num_blocks == expected == 200_977
    assert sizing.usable_blocks == expected - 1
    assert sizing.kv_tokens == (expected - 1) * 16
    assert sizing.blocks_per_seq == 512
    assert sizing.max_concurrency == (expected - 1) // 512 == 392
    assert sizing.pool_bytes <= int(H100 * 0.9) - 3 * GIB < sizing.pool_bytes + DEMO_BLOCK


def test_the_log_line_names_blocks_tokens_and_concurrency():
    sizing = size_kv_pool(H100, 3 * GIB, 0.9, DEMO_BLOCK, block_size=16, max_model_len=8192)
    line = sizing.describe()
    assert "200977 blocks" in line
    assert f"{200_977 * 16} tokens of KV" in line
    assert "at most 392 concurrent sequences of 8192 tokens" in line
    assert "gpu_memory_utilization 0.9 of 80.00 GiB" in line
    assert "3.00 GiB for weights" in line


def test_a_share_too_small_for_one_sequence_is_refused_with_its_numbers():
    # 0.05 of 80 GiB = 4 GiB, minus 3.9 GiB used: 0.1 GiB, 291 blocks; 8192 tokens need 513.
    with pytest.raises(KVMemoryError) as refused:
        size_kv_pool(
            H100, int(3.9 * GIB), 0.05, DEMO_BLOCK, block_size=16, max_model_len=8192,
            scratch_blocks=1,
        )  # fmt: skip
    message = str(refused.value)
    assert "gpu_memory_utilization 0.05 of 80.00 GiB" in message
    assert "leaves 0.100 GiB for the KV pool after 3.900 GiB" in message
    assert "one 8192-token sequence needs 513 blocks of 368640 bytes" in message
    least = (int(3.9 * GIB) + 513 * DEMO_BLOCK) / H100
    assert f"at least {least:.3f}" in message
    # The fraction it names does fit one sequence.
    fits = size_kv_pool(
        H100, int(3.9 * GIB), round(least + 0.0005, 3), DEMO_BLOCK, block_size=16,
        max_model_len=8192, scratch_blocks=1,
    )  # fmt: skip
    assert fits.usable_blocks >= 512


def test_weights_past_the_share_leave_no_pool_and_are_refused():
    with pytest.raises(KVMemoryError, match=r"leaves 0\.000 GiB for the KV pool"):
        size_kv_pool(H100, 75 * GIB, 0.9, DEMO_BLOCK, block_size=16, max_model_len=2048)


def test_a_pool_larger_than_the_free_memory_is_refused():
    with pytest.raises(
        KVMemoryError, match=r"does not fit the 10\.00 GiB the device has free for it"
    ):
        size_kv_pool(
            H100, 3 * GIB, 0.9, DEMO_BLOCK, block_size=16, max_model_len=2048,
            free_bytes=10 * GIB,
        )  # fmt: skip


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fractions_outside_zero_to_one_are_refused(fraction):
    with pytest.raises(KVMemoryError, match="must be in"):
        size_kv_pool(H100, 0, fraction, DEMO_BLOCK, block_size=16, max_model_len=16)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        ModelSettings(gpu_memory_utilization=fraction)


def test_gpu_memory_utilization_must_be_a_number():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ModelSettings(gpu_memory_utilization=True)
    assert ModelSettings(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_a_block_count_overrides_the_sizing_and_cpus_keep_their_default():
    cuda = EngineConfig(device="cuda")
    assert cuda.sizes_kv_from_device
    assert cuda.fixed_kv_blocks is None and cuda.usable_kv_blocks is None
    fixed = EngineConfig(device="cuda", num_kv_blocks=300)
    assert not fixed.sizes_kv_from_device
    assert (fixed.fixed_kv_blocks, fixed.usable_kv_blocks) == (300, 299)  # one scratch
    cpu = EngineConfig(device="cpu")
    assert not cpu.sizes_kv_from_device
    assert (cpu.fixed_kv_blocks, cpu.usable_kv_blocks) == (CPU_KV_BLOCKS, CPU_KV_BLOCKS)


def test_an_engine_without_a_count_on_a_cpu_gets_the_default_pool(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=None)
    assert engine.kv_sizing is None
    assert engine.kv_pool.num_blocks == engine.allocator.num_blocks == CPU_KV_BLOCKS


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ((2048, 512, 64, 8192), [512, 512, 512, 512]),
        ((2048, 512, 3, 8192), [512, 512, 512]),  # max_num_seqs caps the pieces
        ((1000, 512, 64, 8192), [512, 488]),
        ((2048, 512, 64, 300), [299] * 6 + [254]),  # a piece is shorter than max_model_len
        ((16, 512, 64, 8192), [16]),
    ],
)
def test_the_profiling_step_is_the_largest_the_scheduler_can_make(settings, expected):
    assert profile_step_lengths(*settings) == expected


def test_the_profiling_step_runs_over_a_pool_just_big_enough(tiny_llama_dir):
    """The step `profile_memory` times on CUDA, run here: pieces of fresh sequences over
    consecutive blocks, one logits row per piece, every block written."""
    engine = make_engine(tiny_llama_dir, block_size=8)
    lengths = profile_step_lengths(64, 24, 8, 512)
    chunks = profile_chunks(lengths, 8)
    assert lengths == [24, 24, 16]
    assert [c.seq.block_ids for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [c.num_new_tokens for c in chunks] == lengths
    pool = KVCachePool(engine.layout, 8 + 1)
    result = ModelRunner(engine.model, pool).run(chunks)
    assert tuple(result.logits.shape) == (3, engine.spec.vocab_size)
    assert torch.isfinite(result.logits).all()
    written = pool.kv.flatten(1).abs().sum(dim=1)
    assert (written[:8] > 0).all() and written[8] == 0  # the spare (scratch) block untouched
