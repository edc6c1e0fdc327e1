"""Logprobs, penalties, logit_bias, min_tokens and structured output in one engine,
against transformers' logits and hand-computed expectations (no Ray)."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from engine.penalties import RowHistory
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams, StructuredSpec
from tests.factories import _hf_model, assert_no_leaks, make_engine, prompt_of

TOLERANCE = 1e-4


def run(engine, prompt, params, request_id="r", **kwargs):
    seq = engine.add_request(request_id, prompt, params, **kwargs)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return seq, outputs


def hf_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at every position of `token_ids`."""
    with torch.no_grad():
        return _hf_model(str(model_dir))(torch.tensor([token_ids])).logits[0].float()


# --- logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_prompt_and_output_logprobs_equal_transformers_log_softmax(tiny_llama_dir, temperature):
    engine = make_engine(tiny_llama_dir, prefill_chunk_size=8, max_batch_tokens=8)
    prompt = prompt_of(19)  # three chunked-prefill pieces: prompt logprobs cross steps
    params = SamplingParams(
        max_tokens=6,
        temperature=temperature,
        seed=3,
        ignore_eos=True,
        logprobs=4,
        prompt_logprobs=3,
    )
    seq, outputs = run(engine, prompt, params)

    logits = hf_logits(tiny_llama_dir, prompt + seq.output_token_ids)
    prompt_reference = torch.log_softmax(logits, dim=-1)  # prompt logprobs: raw logits
    prompt_entries = outputs[0].prompt_logprobs
    assert prompt_entries[0] is None and len(prompt_entries) == len(prompt)
    for position, entry in enumerate(prompt_entries[1:], start=1):
        row = prompt_reference[position - 1]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - row[prompt[position]].item()) < TOLERANCE
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    output_reference = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    for step, output in enumerate(outputs):
        (entry,) = output.logprobs
        row = output_reference[len(prompt) - 1 + step]
        assert entry.token_id == output.token_ids[0]
        assert abs(entry.logprob - row[entry.token_id].item()) < TOLERANCE
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        top_ids, top_values = [t for t, _ in entry.top], [v for _, v in entry.top]
        assert top_ids == row.topk(4).indices.tolist()
        assert (
            max(abs(a - b) for a, b in zip(top_values, row.topk(4).values.tolist(), strict=True))
            < TOLERANCE
        )
    assert outputs[1].prompt_logprobs is None  # sent once, with the first token
    assert_no_leaks(engine)


def test_logprobs_are_taken_after_bias_penalties_temperature_before_top_k_top_p():
    """The definition, pinned: log_softmax((logits + bias - penalties) / T), untruncated."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 3.0]])
    params = SamplingParams(
        temperature=0.5,
        top_k=2,
        top_p=0.5,
        seed=0,
        logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias=((3, 4.0),),
    )
    history = RowHistory(prompt_token_ids=[1], output_token_ids=[5, 5, 0])
    out = Sampler().run(logits.clone(), [params], [3], [history])

    shaped = torch.tensor([2.0 - 0.25 - 0.5, 1.0, 0.5, 3.0, 0.0, 3.0 - 0.5 - 0.5])
    expected = torch.log_softmax(shaped / 0.5, dim=-1)
    (entry,) = out.logprobs
    assert abs(entry.logprob - expected[entry.token_id].item()) < 1e-6
    # every one of the 5 alternatives has a logprob, though top_k=2 could only draw two
    assert [t for t, _ in entry.top] == expected.topk(5).indices.tolist()
    assert entry.token_id in expected.topk(2).indices.tolist()


# --- penalties --------------------------------------------------------------------------


def test_penalty_formulas_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5]])
    history = RowHistory(prompt_token_ids=[0, 1], output_token_ids=[2, 2, 3])
    params = SamplingParams(
        temperature=0.0,
        logprobs=0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    out = Sampler().run(logits, [params], [3], [history])
    # repetition (prompt or output): 2/2, -1*2, 0.5/2, 1/2; token 4 unseen stays -0.5;
    # then frequency x count and presence on output tokens only (2 twice, 3 once).
    shaped = torch.tensor([1.0, -2.0, 0.25 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, -0.5])
    assert out.tokens == [0]
    assert abs(out.logprobs[0].logprob - torch.log_softmax(shaped, -1)[0].item()) < 1e-6


def penalized_reference(model_dir, prompt, params, max_tokens, eos_ids=()):
    """Greedy decoding on transformers' logits with vLLM's penalty rules written out
    token by token in plain Python: the hand-computed expectation."""
    output: list[int] = []
    for _ in range(max_tokens):
        row = hf_logits(model_dir, prompt + output)[-1].tolist()
        for token_id, bias in params.logit_bias:
            row[token_id] += bias
        if len(output) < params.min_tokens:
            for token_id in set(params.stop_token_ids) | set(eos_ids):
                row[token_id] = -math.inf
        for token_id in range(len(row)):
            if token_id in prompt or token_id in output:
                factor = params.repetition_penalty
                row[token_id] = (
                    row[token_id] / factor if row[token_id] > 0 else row[token_id] * factor
                )
            count = output.count(token_id)
            row[token_id] -= params.frequency_penalty * count
            row[token_id] -= params.presence_penalty * (count > 0)
        token = max(range(len(row)), key=row.__getitem__)
        output.append(token)
        if token in params.stop_token_ids:
            break
    return output


def test_penalized_greedy_on_the_tiny_model_equals_the_hand_computed_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(11)
    plain = run(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.6,
        frequency_penalty=0.9,
        presence_penalty=0.7,
        logit_bias=((prompt[2], 1.5),),
        min_tokens=5,
        stop_token_ids=(plain.output_token_ids[0],),
    )
    seq, _ = run(engine, prompt, params, request_id="p")

    assert seq.output_token_ids == penalized_reference(tiny_llama_dir, prompt, params, 12)
    assert seq.output_token_ids != plain.output_token_ids
    assert_no_leaks(engine)


def test_min_tokens_holds_back_eos_and_stop_ids_then_lets_them_stop(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(9)
    first = run(engine, prompt, SamplingParams(max_tokens=1, temperature=0.0))[0].output_token_ids
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset(first))
    # Without min_tokens the first token is EOS; with it, EOS cannot come before 4 tokens.
    stopped = run(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0), "a")[0]
    held = run(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4), "b")[0]
    assert stopped.output_token_ids == first and stopped.finish_reason == "stop"
    assert len(held.output_token_ids) >= 4 and first[0] not in held.output_token_ids[:4]
    assert_no_leaks(engine)


def test_logit_bias_forces_and_bans(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(9)
    forced = SamplingParams(max_tokens=5, temperature=1.0, seed=1, logit_bias=((42, 100.0),))
    assert run(engine, prompt, forced, "f")[0].output_token_ids == [42] * 5
    free = run(engine, prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    banned = SamplingParams(
        max_tokens=5,
        temperature=0.0,
        ignore_eos=True,
        logit_bias=tuple((t, -100.0) for t in free.output_token_ids),
    )
    assert not set(run(engine, prompt, banned, "b")[0].output_token_ids) & set(
        free.output_token_ids
    )
    assert_no_leaks(engine)


def test_special_tokens_reach_the_text_only_when_asked(tiny_llama_dir):
    """EOS forced mid-output (ignore_eos keeps going): skipped from the text by default,
    as its own text with skip_special_tokens=False; the token ids are the same."""
    engine = make_engine(tiny_llama_dir)
    eos = min(engine.tokenizer.eos_token_ids)
    eos_text = engine.tokenizer.token_text(eos)
    texts = {}
    for skip in (True, False):
        params = SamplingParams(
            max_tokens=3, temperature=0.0, ignore_eos=True, skip_special_tokens=skip,
            logit_bias=((eos, 100.0),),
        )  # fmt: skip
        seq = run(engine, prompt_of(9), params, f"s{skip}")[0]
        assert seq.output_token_ids == [eos] * 3
        texts[skip] = seq.output_text
    assert eos_text and texts == {True: "", False: eos_text * 3}
    assert_no_leaks(engine)


# --- structured output -----------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def test_json_schema_20_seeded_samples_validate(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    prompts = [prompt_of(7 + i % 5, salt=i) for i in range(20)]
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=i, structured=spec) for i in range(20)
    ]
    seqs = engine.generate(prompts, params)
    for seq in seqs:
        assert seq.finish_reason == "stop", seq.output_text
        jsonschema.validate(json.loads(seq.output_text), SCHEMA)
    assert len({s.output_text for s in seqs}) > 10
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "spec, check",
    [
        (
            StructuredSpec("regex", "[0-9]{3}-[a-z]{2,4}"),
            lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,4}", t),
        ),
        (
            StructuredSpec("choice", json.dumps(["Paris", "Berlin", "Tokyo"])),
            lambda t: t in ("Paris", "Berlin", "Tokyo"),
        ),
        (
            StructuredSpec("lark", 'start: "yes" | "no" " thanks"'),
            lambda t: t in ("yes", "no thanks"),
        ),
    ],
    ids=["regex", "choice", "lark"],
)
def test_grammars_hold_for_sampled_output(tiny_llama_dir, spec, check):
    engine = make_engine(tiny_llama_dir)
    for seed in range(4):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured=spec)
        seq = engine.generate([prompt_of(8, salt=seed)], params)[0]
        assert seq.finish_reason == "stop" and check(seq.output_text), seq.output_text
    assert_no_leaks(engine)


def test_json_object_output_is_an_object(tiny_llama_dir):
    """Any object: a random model may write strings past any budget, so the check is
    that every finished answer is an object and every answer starts as one."""
    engine = make_engine(tiny_llama_dir)
    spec = StructuredSpec("json_object")
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured=spec) for i in range(8)
    ]
    seqs = engine.generate([prompt_of(8, salt=i) for i in range(8)], params)
    finished = [s for s in seqs if s.finish_reason == "stop"]
    assert len(finished) >= 2
    assert all(isinstance(json.loads(s.output_text), dict) for s in finished)
    assert all(s.output_text.startswith("{") for s in seqs)
    assert_no_leaks(engine)


def test_resumed_stream_with_penalties_and_a_grammar_equals_uninterrupted(tiny_llama_dir):
    """Migration: a new engine rebuilds penalties and grammar state from the decided
    tokens, so a seeded sampled stream continues exactly."""
    spec = StructuredSpec("regex", "[a-z ]{60}")
    params = SamplingParams(
        max_tokens=80,
        temperature=1.0,
        top_p=0.95,
        seed=17,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        repetition_penalty=1.3,
        structured=spec,
        logprobs=2,
    )
    prompt = prompt_of(21)
    full, full_outputs = run(make_engine(tiny_llama_dir), prompt, params)
    assert len(full.output_token_ids) > 12 and full.finish_reason == "stop"

    other = make_engine(tiny_llama_dir)
    resumed, resumed_outputs = run(
        other, prompt, params, output_token_ids=full.output_token_ids[:9]
    )
    assert resumed.output_token_ids == full.output_token_ids
    # same logprobs (the resumed prompt is computed as a prefill, not step by step)
    for resumed_out, full_out in zip(resumed_outputs, full_outputs[9:], strict=True):
        assert abs(resumed_out.logprobs[0].logprob - full_out.logprobs[0].logprob) < TOLERANCE
    assert_no_leaks(other)


def test_a_bad_grammar_is_refused_when_the_request_arrives(tiny_llama_dir):
    from engine.errors import InvalidRequestError

    engine = make_engine(tiny_llama_dir)
    bad = SamplingParams(structured=StructuredSpec("regex", "(unclosed"))
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", prompt_of(5), bad)
    assert_no_leaks(engine)
