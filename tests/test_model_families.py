"""Every served family against transformers, token for token, and the KV it frees.

Each family is a tiny random-weight checkpoint written by transformers from its own
config class (tests/factories.py): several layers, GQA, a sliding window of 24 tokens
where the family has one (Gemma's alternating with global layers), LongRoPE for
Phi-3, 4-6 experts with top-2 for the mixtures. Prompts run longer than one prefill
chunk (16) and than the window, on the native kernels and on torch.
"""

from __future__ import annotations

import pytest
import torch

from bench.kv_calc import blocks_held_per_request
from engine.block_manager import FREED_BLOCK, blocks_needed
from engine.sampling_params import SamplingParams
from engine.sliding_window import dead_blocks
from tests.factories import (
    NEW_FAMILIES,
    PHI3_ORIGINAL_CONTEXT,
    TINY_WINDOW,
    assert_no_leaks,
    hf_greedy,
    make_engine,
)
from tests.test_engine_correctness import our_greedy_with_logits, prompt_of

CHUNKED = dict(prefill_chunk_size=16, max_batch_tokens=64)
STEP_LOGITS_TOLERANCE = dict(atol=2e-4, rtol=1e-4)
"""Float32 logits of each step against transformers' (the same bound the Llama tests use)."""
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

SHAPES = {
    "qwen3": dict(qk_norm=True, windows=(None, 24, 24, 24), experts=None, fused=False),
    "gemma2": dict(qk_norm=False, windows=(24, None, 24, None), experts=None, fused=False),
    "gemma3": dict(qk_norm=True, windows=(24, 24, None, 24), experts=None, fused=False),
    "phi3": dict(qk_norm=False, windows=(None,) * 4, experts=None, fused=True),
    "mixtral": dict(qk_norm=False, windows=(24,) * 4, experts=(4, 2), fused=False),
    "qwen3_moe": dict(qk_norm=True, windows=(None,) * 4, experts=(6, 2), fused=False),
    "mistral_window": dict(qk_norm=False, windows=(24,) * 4, experts=None, fused=True),
}
"""What each tiny model must come out as: the spec read from its config, and whether
the fused native decode step covers it (a plain Llama-shaped layer; a windowed one while
its sequences fit the window)."""


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_spec_reads_each_family_as_transformers_defines_it(family_model_dirs, family):
    engine = make_engine(family_model_dirs[family])
    spec, shape = engine.spec, SHAPES[family]

    assert spec.qk_norm == shape["qk_norm"]
    assert spec.layer_windows == shape["windows"]
    experts = None if spec.experts is None else (spec.experts.num_experts, spec.experts.top_k)
    assert experts == shape["experts"]
    assert spec.context_window == spec.max_position_embeddings  # windows are served
    expected_fused = shape["fused"] and engine.model.ops.name == "native"
    assert (engine.model.fused_decode is not None) == expected_fused


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("prompt_len", [5, 40])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_greedy_tokens_and_step_logits_equal_transformers(
    family_model_dirs, family, prompt_len, kernels
):
    """40 tokens: longer than a prefill chunk (16) and than the window (24)."""
    model_dir = family_model_dirs[family]
    engine = make_engine(model_dir, kernels=kernels, **CHUNKED)
    prompt = prompt_of(prompt_len)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, 24)

    ours = our_greedy_with_logits(engine, prompt, 24)

    assert ours.argmax(-1).tolist() == ref_tokens
    torch.testing.assert_close(ours, ref_logits, **STEP_LOGITS_TOLERANCE)
    assert_no_leaks(engine)


@pytest.mark.parametrize("family", ["gemma2", "mixtral", "qwen3_moe", "mistral_window"])
def test_batched_generation_of_mixed_lengths_equals_transformers(family_model_dirs, family):
    """Decode rows of different lengths share a step (each its own window start), and
    experts see tokens of several sequences at once."""
    model_dir = family_model_dirs[family]
    engine = make_engine(model_dir, **CHUNKED)
    prompts = [prompt_of(n, salt=5) for n in (3, 17, 30, 41, 9)]

    outputs = engine.generate(prompts, GREEDY)

    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, prompt, 24)[0]
    assert_no_leaks(engine)


def test_phi3_longrope_rotates_short_then_long_as_transformers_decides(family_model_dirs):
    """A prompt within the original context is rotated with the short factors and its
    later tokens with the long ones; a longer prompt with the long ones throughout."""
    model_dir = family_model_dirs["phi3"]
    engine = make_engine(model_dir, **CHUNKED)
    rope = engine.model.rope
    assert rope.long_prompt_from == PHI3_ORIGINAL_CONTEXT
    for prompt_len in (PHI3_ORIGINAL_CONTEXT - 12, PHI3_ORIGINAL_CONTEXT + 1):
        prompt = prompt_of(prompt_len, salt=9)
        expected = hf_greedy(model_dir, prompt, 24)[0]
        assert engine.generate([prompt], GREEDY)[0].output_token_ids == expected
    short_row, long_row = rope.cos[PHI3_ORIGINAL_CONTEXT - 1], rope.cos[rope.max_positions]
    assert not torch.equal(short_row, long_row)  # the halves differ: the test can fail
    assert_no_leaks(engine)


def test_blocks_out_of_every_window_are_freed_as_a_sequence_advances(family_model_dirs):
    """Mistral with a 24-token window over 8-token blocks: after each step the pool holds
    only the blocks from the window's start on, and the output is transformers'."""
    model_dir = family_model_dirs["mistral_window"]
    engine = make_engine(model_dir, **CHUNKED)
    prompt = prompt_of(40, salt=7)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    seq = engine.add_request("long", prompt, params)
    held_per_step = []
    while engine.has_unfinished():
        engine.step()
        if seq.is_finished:
            break
        computed = seq.num_computed_tokens
        expected = blocks_needed(computed, 8) - dead_blocks(computed, TINY_WINDOW, 8)
        held_per_step.append(engine.allocator.num_used)
        assert engine.allocator.num_used == expected, computed
        assert seq.block_ids[: seq.num_freed_blocks] == [FREED_BLOCK] * seq.num_freed_blocks

    assert max(held_per_step) == blocks_needed(TINY_WINDOW, 8) + 1  # of the 10 it spans
    assert max(held_per_step) == blocks_held_per_request(engine.spec, 80, 8)  # kv-calc knows
    assert seq.output_token_ids == hf_greedy(model_dir, prompt, 40)[0]
    assert_no_leaks(engine)


def test_a_model_with_a_global_layer_frees_nothing(family_model_dirs):
    """Gemma 2's global layers read every key: its blocks all stay."""
    engine = make_engine(family_model_dirs["gemma2"], **CHUNKED)
    prompt = prompt_of(40, salt=7)
    seq = engine.add_request("long", prompt, GREEDY)
    while not seq.is_finished:
        engine.step()
        if not seq.is_finished:
            assert engine.allocator.num_used == blocks_needed(seq.num_computed_tokens, 8)
    assert engine.kv_window is None
    assert_no_leaks(engine)


def test_prefix_cache_hits_past_freed_blocks_and_preemption_recomputes(family_model_dirs):
    """A windowed sequence frees its leading blocks, which stay cached (parked): a second
    prompt with the same prefix starts from them; a pool too small for both preempts and
    recomputes. Every output is transformers'."""
    model_dir = family_model_dirs["mistral_window"]
    engine = make_engine(model_dir, prefix_caching=True, **CHUNKED)
    prefix = prompt_of(40, salt=11)
    first, second = [*prefix, 5, 6], [*prefix, 7, 8, 9]

    one = engine.generate([first], GREEDY)[0]
    two = engine.generate([second], GREEDY)[0]

    assert two.num_cached_tokens == 40
    assert one.output_token_ids == hf_greedy(model_dir, first, 24)[0]
    assert two.output_token_ids == hf_greedy(model_dir, second, 24)[0]
    assert_no_leaks(engine)

    tight = make_engine(model_dir, num_kv_blocks=8, **CHUNKED)
    prompts = [prompt_of(n, salt=13) for n in (30, 33, 20)]
    outputs = [s.output_token_ids for s in tight.generate(prompts, GREEDY)]
    assert tight.scheduler.num_preemptions > 0
    assert outputs == [hf_greedy(model_dir, p, 24)[0] for p in prompts]
    assert_no_leaks(tight)


def test_a_prefill_workers_sequence_keeps_every_block_for_its_export(family_model_dirs):
    """`stop_after_prefill` sequences free nothing: the ticket ships the whole prompt."""
    engine = make_engine(family_model_dirs["mistral_window"], **CHUNKED)
    prompt = prompt_of(41, salt=3)
    seq = engine.add_request("p", prompt, GREEDY, stop_after_prefill=True)
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    assert seq.block_ids and FREED_BLOCK not in seq.block_ids
    assert len(seq.block_ids) == blocks_needed(len(prompt), 8)
    exported = engine.export_prefilled("p", lambda s: list(s.block_ids))
    engine.release_blocks(exported)
    assert_no_leaks(engine)


def test_a_ticket_whose_layout_names_another_architecture_is_refused(family_model_dirs):
    """Same bytes per block, other meaning: the layout names the architecture and which
    layers slide, and a receiver refuses a ticket whose layout differs in either."""
    import dataclasses
    import json

    from engine.kv_cache import KVLayout
    from kv_transfer.base import ExportTicket, FailureReason, KVTransferError, check_layout
    from kv_transfer.endpoints import SenderEndpoint

    spec = make_engine(family_model_dirs["gemma2"]).spec
    local = KVLayout.for_model(spec, torch.float32, 8)
    assert (local.architecture, local.sliding_window, local.sliding_layers) == (
        "Gemma2ForCausalLM",
        TINY_WINDOW,
        "0,2",
    )
    assert json.loads(json.dumps(local.as_dict())) == local.as_dict()  # tickets are JSON
    others = [
        dataclasses.replace(spec, layer_windows=(TINY_WINDOW,) * 4),
        dataclasses.replace(spec, family="qwen3", layer_windows=(None, 24, None, 24)),
    ]
    for other in others:
        remote = KVLayout.for_model(other, torch.float32, 8)
        assert remote.block_nbytes == local.block_nbytes
        endpoint = SenderEndpoint("local", "prefill-0", "node")
        ticket = ExportTicket("r", "prefill-0", endpoint, remote, [1], 8, lease_ttl_s=30.0)
        with pytest.raises(KVTransferError) as refused:
            check_layout(ticket, local, "prefill-0")
        assert refused.value.reason == FailureReason.LAYOUT_MISMATCH
    same = ExportTicket("r", "prefill-0", endpoint, local, [1], 8, lease_ttl_s=30.0)
    check_layout(same, local, "prefill-0")
