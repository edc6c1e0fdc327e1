"""Sampling, seeds and stop conditions."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, greedy_tokens
from engine.sampling_params import SamplingParams
from tests.factories import assert_no_leaks, make_engine, prompt_of


def sampled(engine, prompts, params):
    return [s.output_token_ids for s in engine.generate(prompts, params)]


def test_same_seed_same_output_and_independent_of_batch(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(13)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    others = [prompt_of(n, salt=9) for n in (5, 30)]
    other_params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)

    first = sampled(engine, [prompt], params)[0]
    second = sampled(engine, [prompt], params)[0]
    in_batch = sampled(
        engine, [others[0], prompt, others[1]], [other_params, params, other_params]
    )[1]
    other_seed = sampled(
        engine, [prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    )[0]

    assert first == second == in_batch
    assert other_seed != first
    assert_no_leaks(engine)


def test_resumed_tokens_equal_uninterrupted(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(21)
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    full = sampled(engine, [prompt], params)[0]

    seq = engine.add_request("resumed", prompt, params, output_token_ids=full[:7])
    while engine.has_unfinished():
        engine.step()

    assert seq.output_token_ids == full
    assert_no_leaks(engine)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    greedy = logits.argmax(-1).tolist()
    top_k = [SamplingParams(temperature=1.0, top_k=1)] * 4
    top_p = [SamplingParams(temperature=1.0, top_p=1e-6)] * 4
    assert sampler.sample(logits, top_k, [0, 1, 2, 3]) == greedy
    assert sampler.sample(logits, top_p, [0, 1, 2, 3]) == greedy


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(4000, 4).contiguous()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler().sample(logits, params, [0] * 4000)), minlength=4)
    assert counts[3] == 0
    assert abs(counts[0] / 4000 - 0.5) < 0.04 and abs(counts[1] / 4000 - 0.3) < 0.04


def test_top_p_applies_to_the_renormalized_top_k():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(4000, 5).contiguous()
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler().sample(logits, params, [0] * 4000)), minlength=5)
    # top 3 renormalized: 0.47, 0.35, 0.18; the 0.8 nucleus of that is the first two.
    assert counts[2:].sum() == 0
    assert abs(counts[0] / 4000 - 0.4 / 0.7) < 0.04


def test_min_p_keeps_what_is_likely_enough_then_top_p_measures_within_it():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(4000, 5).contiguous()
    params = [SamplingParams(temperature=1.0, min_p=0.3, seed=i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler().sample(logits, params, [0] * 4000)), minlength=5)
    # kept: p >= 0.3 x 0.4 = 0.12, so 0.4, 0.3, 0.15, renormalized over their 0.85
    assert counts[3:].sum() == 0
    assert abs(counts[0] / 4000 - 0.4 / 0.85) < 0.04 and counts[2] > 0
    # top_p 0.8 over the renormalized 0.47, 0.35, 0.18: the first two (over all five
    # it would need the third too)
    both = [SamplingParams(temperature=1.0, min_p=0.3, top_p=0.8, seed=i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler().sample(logits, both, [0] * 4000)), minlength=5)
    assert counts[2:].sum() == 0
    greedy = [SamplingParams(temperature=1.0, min_p=1.0, seed=i) for i in range(64)]
    assert set(Sampler().sample(logits[:64], greedy, [0] * 64)) == {0}


def test_a_nucleus_wider_than_the_candidate_cut_stays_exact():
    vocab = 3000
    # A slow decay: the 0.9 nucleus needs ~2000 tokens, past the 1024-token cut.
    logits = (-torch.arange(vocab, dtype=torch.float32) / 1000).expand(64, vocab).contiguous()
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(64)]
    picked = Sampler().sample(logits, params, [0] * 64)
    weights = logits[0].exp() / logits[0].exp().sum()
    nucleus = int((weights.cumsum(0) - weights < 0.9).sum())  # already in descending order
    assert nucleus > 1024
    assert max(picked) < nucleus and max(picked) > 1024 // 2


def test_max_tokens_stop_token_and_eos(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(9)
    free_run = sampled(
        engine, [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )[0]
    stop_id = free_run[5]

    by_length = engine.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )[0]
    by_stop_id = engine.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop_id,))
    )[0]

    assert by_length.output_token_ids == free_run[:4] and by_length.finish_reason == "length"
    first = free_run.index(stop_id)
    assert (
        by_stop_id.output_token_ids == free_run[: first + 1] and by_stop_id.finish_reason == "stop"
    )
    assert_no_leaks(engine)


def test_eos_ends_generation(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(9)
    free_run = sampled(
        engine, [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )[0]
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset({free_run[3]}))

    seq = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]

    assert seq.output_token_ids == free_run[: free_run.index(free_run[3]) + 1]
    assert seq.finish_reason == "stop"
    assert_no_leaks(engine)


def test_stop_string_cuts_text_and_streams_nothing_past_it(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(9)
    free = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )[0]
    text = free.output_text
    assert len(text) > 12, text
    stop = text[6:9]

    engine.add_request(
        "s", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    )
    streamed, finish = "", None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.text
            finish = out.finish_reason

    assert streamed == text[: text.index(stop)]
    assert finish == "stop"
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_k=-2),
        dict(stop=("",)),
        dict(min_p=1.5),
    ],
)
def test_invalid_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_resume_streams_text_that_was_held_back_elsewhere(tiny_llama_dir):
    """A request migrated after a token that ends mid UTF-8 character loses no text."""
    engine = make_engine(tiny_llama_dir)
    decided = engine.tokenizer.hf.encode("東京は晴れ", add_special_tokens=False)
    cut = next(
        k for k in range(1, len(decided)) if engine.tokenizer.decode(decided[:k]).endswith("\ufffd")
    )
    client_has = engine.tokenizer.decode(decided[:cut]).rstrip("\ufffd")
    params = SamplingParams(max_tokens=cut + 6, temperature=0.0, ignore_eos=True)

    seq = engine.add_request(
        "moved",
        prompt_of(9),
        params,
        output_token_ids=decided[:cut],
        emitted_text_len=len(client_has),
    )
    streamed = ""
    while engine.has_unfinished():
        streamed += "".join(out.text for out in engine.step())

    assert client_has + streamed == engine.tokenizer.decode(seq.output_token_ids)
    assert_no_leaks(engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_pick_the_first_maximum_like_torch(dtype):
    """The numpy argmax of CPU float32 logits (and torch's for other dtypes) picks what
    torch's argmax picks: ties go to the first index, a NaN wins."""
    logits = torch.randn(5, 49152).to(dtype)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie
    logits[2] = 0.0  # all equal
    logits[3, 7] = logits[3, 9] = float("nan")
    picked = greedy_tokens(logits)
    assert picked == logits.argmax(dim=-1).tolist()
    assert picked[1:4] == [10, 0, 7]
