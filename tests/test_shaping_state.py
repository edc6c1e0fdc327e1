"""The state that shapes logits, built once rather than every step (engine/shaping_state.py):
the same logits as the plain per-step formulas, the tensors of a request built once,
output counts kept by counting each new token, and rebuilt from the whole history on
an engine that has not seen the sequence before (no Ray)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from engine import shaping_state
from engine.penalties import RowHistory, apply_logit_bias, ban_stops_before_min_tokens
from engine.sampling_params import SamplingParams
from engine.shaping_state import TokenCounts, logit_bias_of
from tests.factories import assert_no_leaks, make_engine, prompt_of

VOCAB = 9


def biased_by_hand(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    expected = logits.clone()
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            if token_id < logits.shape[-1]:
                expected[row, token_id] += bias
    return expected


@pytest.mark.parametrize(
    "bias",
    [
        ((2, 1.5),),  # a few entries: kept as entries
        ((0, 0.5), (1, -1.0), (3, 2.0), (5, 0.25), (7, -0.5), (8, 3.0)),  # most: a dense row
        ((4, 1.0), (4, 0.5), (12, 9.0), (6, -2.0), (1, 1.0), (0, 1.0)),  # repeated, past vocab
    ],
)
def test_logit_bias_equals_the_entries_added_one_by_one(bias):
    params = [
        SamplingParams(temperature=1.0, logit_bias=bias),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, logit_bias=((VOCAB - 1, -3.0),)),
    ]
    logits = torch.randn(3, VOCAB)
    expected = biased_by_hand(logits, params)

    apply_logit_bias(logits, params)

    assert torch.equal(logits, expected)
    dense = logit_bias_of(params[0], logits).dense
    assert (dense is not None) == (3 * len([t for t, _ in bias if t < VOCAB]) > VOCAB)


def test_min_tokens_ban_covers_stop_ids_and_eos_unless_ignored():
    params = [
        SamplingParams(min_tokens=2, stop_token_ids=(1, 3, 3, 40)),
        SamplingParams(min_tokens=2, stop_token_ids=(1,), ignore_eos=True),
        SamplingParams(min_tokens=1, stop_token_ids=(2,)),  # its minimum is out
    ]
    histories = [RowHistory([0], [5], frozenset({7})) for _ in params]
    logits = torch.zeros(3, VOCAB)

    ban_stops_before_min_tokens(logits, params, histories)

    banned = [torch.isinf(row).nonzero().flatten().tolist() for row in logits]
    assert banned == [[1, 3, 7], [1], []]


def test_each_request_tensor_is_built_once_and_kept_out_of_pickles_and_equality():
    params = SamplingParams(temperature=1.0, logit_bias=((1, 2.0),), stop_token_ids=(3,))
    built = []
    params.derived("k", lambda: built.append(1) or "first")
    assert params.derived("k", lambda: built.append(1) or "second") == "first"
    assert built == [1]
    logit_bias_of(params, torch.zeros(1, VOCAB))

    for other in (pickle.loads(pickle.dumps(params)), copy.deepcopy(params)):
        assert other == params and "_derived" not in other.__dict__
    assert "_derived" not in dataclasses.replace(params, seed=1).__dict__


def test_counts_grow_by_the_new_tokens_and_start_over_on_a_shorter_history():
    like = torch.zeros(1, VOCAB)
    counts = TokenCounts()
    output = [4, 4, 2]
    assert counts.sync(output, like).tolist() == [0, 0, 1, 0, 2, 0, 0, 0, 0]
    output += [4, 8, 30]  # 30 lies past the vocabulary: not counted
    assert counts.sync(output, like).tolist() == [0, 0, 1, 0, 3, 0, 0, 0, 1]
    assert counts.counted == 6
    assert counts.prompt_seen([1, 1, 5]).nonzero().flatten().tolist() == [1, 5]
    assert counts.sync([3], like).tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0]


class BuildCounter:
    def __init__(self, monkeypatch):
        self.calls: dict[str, int] = {"bias": 0, "banned": 0}
        for name, function in (("bias", shaping_state._bias), ("banned", shaping_state._banned)):
            monkeypatch.setattr(shaping_state, f"_{name}", self.counted(name, function))

    def counted(self, name, function):
        def wrapper(*args):
            self.calls[name] += 1
            return function(*args)

        return wrapper


def test_an_engine_builds_a_requests_tensors_once_and_counts_each_token_once(
    tiny_llama_dir, monkeypatch
):
    """Four choices share one SamplingParams: one build of the bias and of the banned
    ids for all of them over every step; each sequence's counts equal its output's."""
    builds = BuildCounter(monkeypatch)
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(
        max_tokens=8,
        temperature=1.0,
        seed=3,
        ignore_eos=True,
        min_tokens=6,
        stop_token_ids=(5,),
        logit_bias=((9, 1.0), (11, -2.0)),
        frequency_penalty=0.5,
    )
    seqs = engine.generate([prompt_of(7, salt=i) for i in range(4)], params)

    assert builds.calls == {"bias": 1, "banned": 1}
    for seq in seqs:
        assert len(seq.output_token_ids) == 8 and 5 not in seq.output_token_ids[:6]
        counts = seq.token_counts.output
        expected = torch.bincount(torch.tensor(seq.output_token_ids[:-1]), minlength=len(counts))
        assert seq.token_counts.counted == 7  # no step sampled after the last token
        assert counts.tolist() == expected.float().tolist()
    assert_no_leaks(engine)


def test_a_resumed_sequence_counts_its_whole_history_at_its_first_step(tiny_llama_dir):
    """A sequence whose tokens were decided on another engine (a migration) starts with
    no counts here: its first step counts all of them."""
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, presence_penalty=1.0)
    decided = [7, 7, 12]
    seq = engine.add_request("r", prompt_of(9), params, output_token_ids=decided)
    assert seq.token_counts is None

    engine.step()

    counts = seq.token_counts.output
    assert seq.token_counts.counted == 3 and counts.sum().item() == 3
    assert (counts[7].item(), counts[12].item()) == (2, 1)
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)
