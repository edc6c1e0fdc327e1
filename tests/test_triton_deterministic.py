"""Deterministic mode on the GPU path's Triton kernels: a row's attention, projections and
norms have the same bits whatever the rows beside it, and the engine on that path gives
a row the same logits in any batch and any chunking.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is first imported), float32 only (the interpreter rounds bf16 by
truncation); with CUDA they run compiled and the same comparisons hold.
"""

from __future__ import annotations

import os

import pytest
import torch

# Before anything imports triton: the interpreter is chosen when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.attention import SeqBatch
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.triton_backend import triton_runs_on
from tests.factories import assert_no_leaks, hf_greedy, make_engine, prompt_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_runs_on(DEVICE) is not None, reason=str(triton_runs_on(DEVICE))
)


def kernels():
    from engine.kernels import triton_attention, triton_invariant

    return triton_attention, triton_invariant


def paged_pool(lengths, block_size=16, num_kv_heads=2, group=3, head_dim=64, seed=0):
    """One layer's keys and values (random, float32) and block tables over shuffled blocks
    for sequences of `lengths` tokens, and a query row per sequence."""
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    keys, values = (torch.randn(shape, generator=generator).to(DEVICE) for _ in range(2))
    order = torch.randperm(num_blocks, generator=generator)[: len(lengths) * width]
    tables = order.view(len(lengths), width).to(DEVICE)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=generator)
    return q.to(DEVICE), keys, values, tables


def decode(rows, q, keys, values, tables, lengths, deterministic, splits=None):
    attention, _ = kernels()
    pick = torch.tensor(rows, device=DEVICE)
    out = torch.empty(len(rows), q.shape[1] * q.shape[2], device=DEVICE)
    lens = torch.tensor([lengths[r] for r in rows], device=DEVICE)
    attention.decode_attention(q[pick], keys, values, tables[pick], lens, q.shape[2] ** -0.5, out,
                               num_splits=splits, deterministic=deterministic)  # fmt: skip
    return out


LENGTHS = [300, 17, 129, 64, 1, 250, 33, 90]


def test_deterministic_decode_is_never_split_whatever_the_batch(monkeypatch):
    """On a GPU the split count follows the batch (programs to fill the multiprocessors);
    in deterministic mode it is 1 at every batch size."""
    attention, _ = kernels()
    monkeypatch.setattr(attention, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert attention.decode_splits(1, 8, 4096, cuda) > 1
    for rows in (1, 3, 8, 16, 64):
        assert attention.decode_splits(rows, 8, 4096, cuda, deterministic=True) == 1


def test_a_decode_rows_attention_is_the_same_bits_in_any_batch():
    """Row 0 alone, then among 3 and 8 rows, at any position, and with a split count
    asked for: deterministic mode gives one set of bits."""
    q, keys, values, tables = paged_pool(LENGTHS)
    expected = decode([0], q, keys, values, tables, LENGTHS, True)[0]
    for rows in ([0, 1, 2], [3, 4, 0], list(range(8)), [7, 6, 5, 4, 0, 3, 2, 1]):
        got = decode(rows, q, keys, values, tables, LENGTHS, True, splits=4)
        assert torch.equal(got[rows.index(0)], expected), rows


def test_a_split_row_sums_its_keys_in_another_order():
    """Why splits are off in deterministic mode: the same row split over four programs
    and merged gets other bits than unsplit."""
    q, keys, values, tables = paged_pool(LENGTHS)
    unsplit = decode([0], q, keys, values, tables, LENGTHS, False, splits=1)
    split = decode([0], q, keys, values, tables, LENGTHS, False, splits=4)
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)
    assert not torch.equal(split, unsplit)


@pytest.mark.parametrize("query_len", [1, 5, 40, 300])
def test_a_token_attends_with_the_same_bits_as_a_decode_row_or_in_any_prefill_chunk(
    query_len,
):
    """A sequence's last token as a decode row, and as the last row of a prefill chunk of
    1, 5, 40 or all 300 tokens (after the rest as cached context, beside another
    sequence's chunk): the same bits in deterministic mode."""
    attention, _ = kernels()
    lengths = [300, 77]
    q, keys, values, tables = paged_pool(lengths)
    expected = decode([0], q, keys, values, tables, lengths, True)[0]
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(query_len + 20, *q.shape[1:], generator=generator).to(DEVICE)
    rows[query_len - 1] = q[0]
    batch = SeqBatch(
        query_starts=torch.tensor([0, query_len, query_len + 20], device=DEVICE),
        seq_lens=torch.tensor([300, 77], device=DEVICE),
        block_tables=tables,
        max_query_len=max(query_len, 20),
    )
    out = torch.empty(query_len + 20, q.shape[1] * q.shape[2], device=DEVICE)
    attention.prefill_attention(rows, keys, values, batch, q.shape[2] ** -0.5, out,
                                deterministic=True)  # fmt: skip
    assert torch.equal(out[query_len - 1], expected)


DTYPES = pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter truncates bf16"),
        ),
    ],
    ids=str,
)


@DTYPES
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_projection_rows_bits_do_not_depend_on_the_number_of_rows(with_bias, dtype):
    """1 to 130 rows (three 64-row tiles), K not a multiple of the K step, N not of the
    column tile: rows 0 and 1 the same bits every time, and a row moved to another place
    in its tile too; near the float64 product."""
    _, invariant = kernels()
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 150, generator=generator).to(DEVICE, dtype)
    bias = torch.randn(200, generator=generator).to(DEVICE, dtype) if with_bias else None
    x = torch.randn(130, 150, generator=generator).to(DEVICE, dtype)
    expected = invariant.matmul(x[:2], weight, bias)
    for rows in (3, 8, 16, 65, 130):
        out = invariant.matmul(x[:rows], weight, bias)
        assert torch.equal(out[:2], expected), rows
    moved = invariant.matmul(torch.cat([x[2:39], x[:1], x[39:70]]), weight, bias)
    assert torch.equal(moved[37], expected[0])
    reference = invariant.reference_matmul(x, weight, bias)
    bound = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.double(), reference, atol=bound * 10, rtol=bound)


def test_a_norm_rows_bits_do_not_depend_on_the_number_of_rows():
    _, invariant = kernels()
    generator = torch.Generator().manual_seed(6)
    weight = (torch.rand(1500, generator=generator) + 0.5).to(DEVICE)
    x = (torch.randn(40, 1500, generator=generator) * 30).to(DEVICE)
    expected = invariant.rms_norm(x[:1], weight, 1e-5)
    for rows in (3, 8, 16, 40):
        assert torch.equal(invariant.rms_norm(x[:rows], weight, 1e-5)[:1], expected), rows
    reference = invariant.reference_rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(invariant.rms_norm(x, weight, 1e-5), reference)


# --- the engine on the Triton path -------------------------------------------------------

ENGINE_LENGTHS = [42, 9, 27, 5]
"""None ends a block of 8: `decode_row` finds each stream's next slot allocated."""


def triton_engine(model_dir, **overrides):
    settings = dict(attention_backend="triton", deterministic=True, device=DEVICE)
    return make_engine(model_dir, **{**settings, **overrides})


@pytest.mark.slow
def test_the_engine_gives_a_decode_row_the_same_logits_in_batches_of_1_3_and_4(tiny_llama_dir):
    engine = triton_engine(tiny_llama_dir)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, n in enumerate(ENGINE_LENGTHS):
        engine.add_request(f"r{i}", prompt_of(n, salt=i), greedy)
    while not all(s.output_token_ids for s in engine.sequences.values()):
        engine.step()
    seqs = [engine.sequences[f"r{i}"] for i in range(len(ENGINE_LENGTHS))]
    expected = engine.runner.run([ScheduledChunk(seqs[0], 1)]).logits[0].clone()
    for batch in (seqs[2:4] + seqs[:1], seqs[1:] + seqs[:1]):
        logits = engine.runner.run([ScheduledChunk(s, 1) for s in batch]).logits
        assert torch.equal(logits[-1], expected), len(batch)
    for seq in seqs:
        engine.abort(seq.request_id)
    assert_no_leaks(engine)


def first_logits(engine, prompt) -> torch.Tensor:
    captured = []
    run = engine.runner.run

    def capturing(chunks):
        result = run(chunks)
        captured.extend(row.clone() for row in result.logits)
        return result

    engine.runner.run = capturing
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    engine.runner.run = run
    assert_no_leaks(engine)
    return captured[0]


def test_the_engine_gives_a_prompt_the_same_logits_in_one_chunk_or_with_a_lone_last_token(
    tiny_llama_dir,
):
    """41 tokens in one chunk, and in chunks of 20 (the last a lone token, which runs as
    a decode row): the same bits."""
    prompt = prompt_of(41, salt=2)
    whole = first_logits(triton_engine(tiny_llama_dir, prefill_chunk_size=64), prompt)
    pieces = first_logits(triton_engine(tiny_llama_dir, prefill_chunk_size=20), prompt)
    assert torch.equal(pieces, whole)


@pytest.mark.slow
def test_greedy_on_the_deterministic_triton_path_equals_transformers(tiny_llama_dir):
    engine = triton_engine(tiny_llama_dir)
    prompts = [prompt_of(n, salt=4) for n in (5, 23)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt, seq in zip(prompts, engine.generate(prompts, params), strict=True):
        assert seq.output_token_ids == hf_greedy(tiny_llama_dir, prompt, 6, DEVICE)[0]
    assert_no_leaks(engine)
