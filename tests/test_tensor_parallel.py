"""Tensor parallelism in the engine: the split arithmetic, sliced weight loading, and
greedy output of 2 ranks (threads of this process over gloo, one torch thread each)
equal to one rank and to transformers, token for token, in float32."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.errors import ModelLoadError
from engine.model_spec import load_model_spec
from engine.parallel.shard import (
    ModelShard,
    Span,
    TPSplitError,
    check_split,
    head_split,
    vocab_split,
)
from engine.sampling_params import SamplingParams
from engine.weights import load_weights
from tests.factories import (
    TP_FAMILIES,
    assert_no_leaks,
    hf_greedy,
    make_engine,
    prompt_of,
    tp_engine,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (5, 17, 30)
"""One block and less, a prompt over two prefill chunks (16), one near four blocks."""


@pytest.fixture(scope="module")
def model_dirs(tp_model_dirs):
    return tp_model_dirs


# --- who owns what ------------------------------------------------------------------


def test_heads_split_evenly_when_kv_heads_divide():
    shards = [head_split(8, 2, 2, rank) for rank in range(2)]
    assert [(s.q, s.kv) for s in shards] == [
        (Span(0, 4), Span(0, 1)),
        (Span(4, 4), Span(1, 1)),
    ]
    assert not any(s.kv_replicated for s in shards)


def test_fewer_kv_heads_than_ranks_are_replicated_as_vllm_does():
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 head 1.
    shards = [head_split(8, 2, 4, rank) for rank in range(4)]
    assert [s.kv for s in shards] == [Span(0, 1), Span(0, 1), Span(1, 1), Span(1, 1)]
    assert [s.q for s in shards] == [Span(0, 2), Span(2, 2), Span(4, 2), Span(6, 2)]
    assert all(s.kv_replicated for s in shards)
    # Each rank's query heads all read its one KV head (4 query heads per KV head).
    for shard in shards:
        groups = {q // 4 for q in range(shard.q.start, shard.q.stop)}
        assert groups == {shard.kv.start}
    assert head_split(4, 1, 2, 1).kv == Span(0, 1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "says"),
    [
        (9, 3, 2, "9 attention heads"),
        (8, 6, 4, "6 KV heads"),
        (12, 4, 8, "12 attention heads"),
        (6, 2, 3, "replicate"),
    ],
)
def test_splits_that_do_not_divide_are_refused_naming_the_numbers(heads, kv_heads, size, says):
    with pytest.raises(TPSplitError, match=says) as caught:
        check_split(heads, kv_heads, size)
    assert f"tp={size}" in str(caught.value)
    assert isinstance(caught.value, ModelLoadError)


def test_vocab_is_padded_to_equal_slices():
    shards = [vocab_split(385, 2, rank) for rank in range(2)]
    assert [(s.real, s.per_rank) for s in shards] == [(Span(0, 193), 193), (Span(193, 192), 193)]
    assert vocab_split(10, 4, 3).real == Span(9, 1)
    assert Span(0, 4).overlap(Span(2, 4)) == Span(2, 2)
    assert Span(0, 2).overlap(Span(2, 2)) is None


def test_a_model_whose_heads_do_not_split_is_refused_at_load(model_dirs):
    spec = load_model_spec(model_dirs["llama"])  # 9 heads, 3 KV heads
    with pytest.raises(TPSplitError, match="tp=2 cannot split llama's 9 attention heads"):
        ModelShard.of(spec, 2, 0)


# --- each rank reads its slices only --------------------------------------------------


def test_each_rank_reads_only_its_slices_and_the_slices_make_the_whole(model_dirs, monkeypatch):
    model_dir = model_dirs["llama_kv2"]
    spec = load_model_spec(model_dir)
    whole = load_weights(model_dir, spec, torch.float32, "cpu")
    with Checkpoint(model_dir) as checkpoint:
        total = sum(
            torch.tensor(checkpoint.shape(name)).prod().item() * 4 for name in checkpoint.unused
        )
    read: list[int] = []
    close = Checkpoint.close
    monkeypatch.setattr(
        Checkpoint, "close", lambda self: (read.append(self.bytes_read), close(self))
    )
    ranks = [
        load_weights(model_dir, spec, torch.float32, "cpu", ModelShard.of(spec, 2, r))
        for r in range(2)
    ]
    # Norms are replicated (a few hundred floats); everything else is read once overall.
    norms = sum(w.numel() * 4 for w in whole.layers[0].norms().values()) * spec.num_layers
    assert all(r < total / 2 + norms + 4096 for r in read), (read, total)
    layer = [r.layers[1] for r in ranks]
    dim, kv = spec.head_dim, spec.num_kv_heads * spec.head_dim // 2
    q = [w.qkv.weight[: 4 * dim] for w in layer]
    assert torch.equal(torch.cat(q), whole.layers[1].qkv.weight[: 8 * dim])
    k = [w.qkv.weight[4 * dim : 4 * dim + kv] for w in layer]
    assert torch.equal(torch.cat(k), whole.layers[1].qkv.weight[8 * dim : 8 * dim + 2 * kv])
    o_proj = torch.cat([w.o_proj.weight for w in layer], dim=1)
    assert torch.equal(o_proj, whole.layers[1].o_proj.weight)
    down = torch.cat([w.down.weight for w in layer], dim=1)
    assert torch.equal(down, whole.layers[1].down.weight)
    lm_head = torch.cat([r.lm_head.weight for r in ranks])
    assert torch.equal(lm_head[: spec.vocab_size], whole.lm_head.weight)
    assert not lm_head[spec.vocab_size :].any()  # the padding row


# --- 2 ranks == 1 rank == transformers ------------------------------------------------


def _greedy(engine) -> list[list[int]]:
    prompts = [prompt_of(n) for n in PROMPT_LENGTHS]
    outputs = [seq.output_token_ids for seq in engine.generate(prompts, GREEDY)]
    assert_no_leaks(engine)
    return outputs


@pytest.mark.parametrize(
    ("family", "kernels"),
    [(f, "auto") for f in TP_FAMILIES] + [("mistral_kv1", "torch")],
)
def test_two_ranks_equal_one_rank_equal_transformers(model_dirs, family, kernels, caplog):
    model_dir = model_dirs[family]
    expected = [hf_greedy(model_dir, prompt_of(n), 10)[0] for n in PROMPT_LENGTHS]
    assert _greedy(make_engine(model_dir, kernels=kernels)) == expected
    with (
        caplog.at_level(logging.INFO, logger="engine.model"),
        tp_engine(model_dir, kernels=kernels) as engine,
    ):
        assert engine.model.fused_decode is None
        assert engine.kv_pool.layout.tp_size == 2
        assert _greedy(engine) == expected
        follower = engine.followers[1]
        assert follower.steps > 0 and follower.kv_pool.num_blocks == engine.kv_pool.num_blocks
    replicated = "KV heads replicated" in caplog.text
    assert replicated == (load_model_spec(model_dir).num_kv_heads < 2)


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_norms_after_the_reduce_and_split_experts(model_dirs, family):
    """Gemma's norms of the attention and MLP outputs run on the reduced sum; each
    expert of a mixture splits its intermediate dimension."""
    model_dir = model_dirs[family]
    expected = [hf_greedy(model_dir, prompt_of(n), 10)[0] for n in PROMPT_LENGTHS]
    with tp_engine(model_dir) as engine:
        assert _greedy(engine) == expected


def test_prompt_logprobs_and_a_mixed_batch_match_one_rank(model_dirs):
    """A step with decode rows and prefill chunks together, and extra logits rows for
    prompt logprobs, gathers the same logits on 2 ranks as on 1."""
    model_dir = model_dirs["qwen2"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    def run(engine):
        engine.add_request("a", prompt_of(9), GREEDY)
        for _ in range(3):
            engine.step()
        engine.add_request("b", prompt_of(21, salt=1), params)
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        assert_no_leaks(engine)
        tokens = {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
        prompt = next(o.prompt_logprobs for o in outputs["b"] if o.prompt_logprobs)
        return tokens, prompt

    one_tokens, one_prompt = run(make_engine(model_dir))
    with tp_engine(model_dir) as engine:
        two_tokens, two_prompt = run(engine)
    assert two_tokens == one_tokens
    assert len(two_prompt) == len(one_prompt)
    for mine, theirs in zip(two_prompt, one_prompt, strict=True):
        if mine is None:
            assert theirs is None
            continue
        assert (mine.token_id, mine.rank) == (theirs.token_id, theirs.rank)
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_every_rank_runs_the_deterministic_kernels_when_asked(model_dirs):
    """Rank 0 and its followers build their forward from one function of the config, so
    `deterministic` reaches every rank (a copy of rank 0's construction in the follower
    once left it out: rank 1 ran the default kernels)."""
    model_dir = model_dirs["qwen2"]
    expected = [hf_greedy(model_dir, prompt_of(n), 10)[0] for n in PROMPT_LENGTHS]
    with tp_engine(model_dir, deterministic=True) as engine:
        assert _greedy(engine) == expected
        assert engine.model.deterministic and engine.followers[1].model.deterministic
