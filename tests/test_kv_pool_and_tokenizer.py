"""Block allocator, KV block read/write, config validation, incremental detokenizer."""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockAllocator
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, OutOfBlocksError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.factories import assert_no_leaks, make_engine, prompt_of


def test_allocator_refcounts_free_list_and_leak_check():
    allocator = BlockAllocator(4)
    first = allocator.allocate(3)
    assert allocator.can_allocate(1) and not allocator.can_allocate(2)
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(2, request_id="req-7")
    allocator.share(first[:1])
    allocator.free(first)
    with pytest.raises(AssertionError, match="leaked"):
        allocator.assert_all_free()
    allocator.free(first[:1])
    allocator.assert_all_free()
    with pytest.raises(AssertionError, match="double free"):
        allocator.free(first[:1])


def test_out_of_blocks_error_names_the_request():
    with pytest.raises(OutOfBlocksError, match="req-9"):
        BlockAllocator(1).allocate(2, request_id="req-9")


def test_a_cpu_pool_is_zero_and_fills_in_on_first_touch(tmp_path):
    """The pool reads as zeros, takes RAM only where written (what soaks subtract from
    a worker's RSS), and a pool moved into a shared file counts as none of it."""
    from engine.kv_cache import KVCachePool, KVLayout

    layout = KVLayout("t", "float32", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
    pool = KVCachePool(layout, 256)  # 256 blocks of 128 KiB: 32 MiB
    assert pool.private_resident_bytes() < 4 << 20
    pool.kv[:64].fill_(1.0)  # 8 MiB written
    resident = pool.private_resident_bytes()
    assert 8 << 20 <= resident <= 14 << 20  # plus at most the huge pages either side
    assert not pool.kv[64::17].any()  # (read after: reads map the zero page, also counted)
    pool.move_to_shared_memory(str(tmp_path / "pool.kv"), keep_contents=True)
    assert pool.private_resident_bytes() == 0 and float(pool.kv[63].sum()) == 128 * 256


def test_prefault_maps_the_whole_pool_in_pieces_and_keeps_what_it_holds(tmp_path):
    """The warming thread's call: piece by piece until the pool is resident, blocks in
    use untouched; a pool moved into a shared file is warmed from its start again."""
    from engine.kv_cache import KVCachePool, KVLayout

    layout = KVLayout("t", "float32", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
    pool = KVCachePool(layout, 128)  # 16 MiB
    pool.kv[5].fill_(3.0)
    pieces = 1
    while pool.prefault(2 << 20):
        pieces += 1
    assert pieces == 8 and not pool.prefault(2 << 20)
    assert pool.private_resident_bytes() >= 16 << 20
    assert float(pool.kv[5].sum()) == 3.0 * pool.kv[5].numel() and not pool.kv[6].any()
    pool.move_to_shared_memory(str(tmp_path / "pool.kv"), keep_contents=True)
    assert pool.prefault(2 << 20) and float(pool.kv[5].sum()) == 3.0 * pool.kv[5].numel()


def test_read_and_write_blocks_move_a_request_between_pools(tiny_llama_dir):
    """Export a prefilled request's blocks from one engine, import into another, decode on."""
    source, target = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir, num_kv_blocks=64)
    prompt = prompt_of(30)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = source.generate([prompt], params)[0].output_token_ids

    source.add_request("r", prompt, params, stop_after_prefill=True)
    while source.has_unfinished():
        source.step()
    exported, first, lent = source.export_prefilled(
        "r",
        lambda seq: (
            source.kv_pool.read_blocks(seq.block_ids),
            seq.output_token_ids,
            seq.block_ids,
        ),
    )
    imported = target.begin_import("r", prompt, first, params, len(prompt))
    assert target.reserve_imports() == [imported]
    target.kv_pool.write_blocks(imported.block_ids, exported)
    source.release_blocks(lent)  # what the sender's lease does on ack
    assert torch.equal(target.kv_pool.read_blocks(imported.block_ids), exported)

    assert target.finish_import("r", ok=True, recompute=False)
    while target.has_unfinished():
        target.step()

    assert imported.output_token_ids == expected
    assert_no_leaks(source)
    assert_no_leaks(target)


def test_engine_rejects_prompts_longer_than_the_context(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="64 tokens"):
        engine.add_request("long", prompt_of(64), SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=0),
        dict(dtype="int8"),
        dict(prefill_chunk_size=4096, max_batch_tokens=512),
        dict(num_threads=0),
    ],
)
def test_engine_config_validates(bad):
    with pytest.raises(ValueError):
        EngineConfig(**bad)


@pytest.mark.parametrize(
    "text",
    [
        " Grüße aus Köln",
        "東京は晴れです。",
        " emoji 🙂🚀 done",
        "  two  spaces\nnew line",
        "naïve café",
    ],
)
def test_incremental_detokenizer_streams_exact_text(tiny_llama_dir, text):
    tokenizer = Tokenizer(tiny_llama_dir)
    prompt = tokenizer.encode("The quick brown fox")
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)

    deltas = [detok.push(token) for token in ids]

    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
