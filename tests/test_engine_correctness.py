"""Our paged forward against transformers, and against itself under batching/chunking."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.factories import (
    assert_no_leaks,
    hf_greedy,
    make_engine,
    our_greedy_with_logits,
    prompt_of,
)

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [1, 5, 8, 13, 30, 41]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("prompt_len", [5, 13, 30])
def test_logits_and_greedy_tokens_match_transformers(tiny_model_dirs, family, prompt_len):
    model_dir = tiny_model_dirs[family]
    engine = make_engine(model_dir)
    prompt = prompt_of(prompt_len)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, 32)

    ours = our_greedy_with_logits(engine, prompt, 32)

    torch.testing.assert_close(ours, ref_logits, atol=2e-4, rtol=1e-4)
    assert ours.argmax(-1).tolist() == ref_tokens
    assert_no_leaks(engine)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_generation_equals_each_sequence_alone(tiny_model_dirs, family):
    engine = make_engine(tiny_model_dirs[family])
    prompts = [prompt_of(n) for n in PROMPT_LENGTHS]

    alone = [engine.generate([p], GREEDY)[0].output_token_ids for p in prompts]
    together = [s.output_token_ids for s in engine.generate(prompts, GREEDY)]

    assert together == alone
    assert all(len(tokens) == 32 for tokens in together)
    assert_no_leaks(engine)


def test_batched_equals_transformers_for_mixed_lengths(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = [prompt_of(n, salt=1) for n in PROMPT_LENGTHS]

    outputs = engine.generate(prompts, GREEDY)

    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_token_ids == hf_greedy(tiny_llama_dir, prompt, 32)[0]
    assert_no_leaks(engine)


@pytest.mark.parametrize("chunk_size", [3, 8, 11])
def test_chunked_prefill_equals_one_shot(tiny_llama_dir, chunk_size):
    one_shot = make_engine(tiny_llama_dir, prefill_chunk_size=512, max_batch_tokens=512)
    chunked = make_engine(
        tiny_llama_dir, prefill_chunk_size=chunk_size, max_batch_tokens=max(chunk_size, 16)
    )
    prompts = [prompt_of(n, salt=2) for n in (9, 30, 41)]

    expected = [s.output_token_ids for s in one_shot.generate(prompts, GREEDY)]
    actual = [s.output_token_ids for s in chunked.generate(prompts, GREEDY)]

    assert actual == expected
    assert_no_leaks(one_shot)
    assert_no_leaks(chunked)


def test_preemption_under_a_tiny_pool_recomputes_to_the_same_output(tiny_llama_dir):
    roomy = make_engine(tiny_llama_dir)
    # 12 blocks of 8 tokens cannot hold six sequences of ~40-70 tokens at once.
    tight = make_engine(tiny_llama_dir, num_kv_blocks=12)
    prompts = [prompt_of(n, salt=3) for n in (20, 25, 30, 33, 12, 7)]

    expected = [s.output_token_ids for s in roomy.generate(prompts, GREEDY)]
    actual = [s.output_token_ids for s in tight.generate(prompts, GREEDY)]

    assert tight.scheduler.num_preemptions > 0
    assert actual == expected
    assert_no_leaks(tight)


def test_abort_frees_blocks_mid_decode(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", prompt_of(30), GREEDY)
    engine.add_request("b", prompt_of(13), GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.allocator.num_used > 0

    assert engine.abort("a")
    assert not engine.abort("a")
    while engine.has_unfinished():
        engine.step()

    assert_no_leaks(engine)
