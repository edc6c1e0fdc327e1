"""Deterministic mode (`deterministic: true`) on the native CPU kernels: a row's logits and
KV get the same bits whatever its batch, the chunking of its prompt, its prefix-cache
hits, and whether its tokens were decoded or recomputed (a migrated stream); with the
mode off, the same batch still gives the same output. Greedy output equals
transformers' in both modes.

Every comparison is bit for bit (`torch.equal`) on the logits the sampler drew from.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.config import EngineConfig
from engine.demo_model import prepare_demo_model
from engine.native.build import build_library
from engine.native.ops import NativeKernels, native_kernels
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from tests.factories import assert_no_leaks, hf_greedy, make_engine, prompt_of

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C compiler here")

LENGTHS = [150, 21, 137, 9, 65, 33, 5, 129, 47, 17, 158, 12, 86, 42, 101, 3]
"""Prompts of 16 streams: 16 blocks of 8 and more (the default decode kernel splits such
rows into spans at small batches), short ones, a lone token. None ends a block, so each
stream's next slot is already allocated when `decode_row` runs it by hand."""
SEEDED = [
    SamplingParams(max_tokens=8, temperature=0.8, seed=100 + i, ignore_eos=True)
    for i in range(len(LENGTHS))
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def deterministic_engine(model_dir, **overrides):
    settings = dict(deterministic=True, num_kv_blocks=512)
    return make_engine(model_dir, **{**settings, **overrides})


@contextmanager
def recorded_logits(engine) -> Iterator[dict[str, list[torch.Tensor]]]:
    """request id -> the logits row of each of its sampled steps, in order, while inside."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    run = engine.runner.run

    def recording(chunks):
        result = run(chunks)
        for seq, row in zip(result.sampling_seqs, result.logits, strict=True):
            seen[seq.request_id].append(row.clone())
        return result

    engine.runner.run = recording
    try:
        yield seen
    finally:
        engine.runner.run = run


def run_together(engine, requests) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """(request id -> output tokens, request id -> logits rows) of `requests`, a list of
    (id, prompt, params) added at once and run to the end."""
    with recorded_logits(engine) as seen:
        seqs = [engine.add_request(rid, prompt, params) for rid, prompt, params in requests]
        while engine.has_unfinished():
            engine.step()
    assert_no_leaks(engine)
    return {s.request_id: s.output_token_ids for s in seqs}, dict(seen)


def run_one_at_a_time(engine, requests):
    tokens, logits = {}, {}
    for request in requests:
        one_tokens, one_logits = run_together(engine, [request])
        tokens |= one_tokens
        logits |= one_logits
    return tokens, logits


def assert_same_bits(expected: dict, got: dict, ids) -> None:
    for rid in ids:
        assert len(got[rid]) == len(expected[rid]), rid
        for step, (want, have) in enumerate(zip(expected[rid], got[rid], strict=True)):
            assert torch.equal(want, have), f"{rid} step {step}"


def seeded_requests(prefix: str = "s"):
    return [
        (f"{prefix}{i}", prompt_of(n, salt=i), params)
        for i, (n, params) in enumerate(zip(LENGTHS, SEEDED, strict=True))
    ]


# --- one row, every batch ---------------------------------------------------------------


def decode_ready(engine, lengths):
    """Sequences of `lengths` prompts, prefilled with their first token sampled, ready
    for a decode step (`ScheduledChunk(seq, 1)`)."""
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", prompt_of(n, salt=i), GREEDY)
    while not all(s.output_token_ids for s in engine.sequences.values()):
        engine.step()
    return [engine.sequences[f"r{i}"] for i in range(len(lengths))]


def decode_row(engine, batch, row: int, fused: bool) -> torch.Tensor:
    """Logits of `batch[row]` in one decode step of `batch` (the fused kernel or the
    operation-by-operation forward); the step writes only the rows' own next slots."""
    chunks = [ScheduledChunk(seq, 1) for seq in batch]
    if fused:
        return engine.runner.run(chunks).logits[row].clone()
    step = engine.runner.build_step(chunks)
    model = engine.model
    return model.forward(step.input_ids, step.positions, step.meta, engine.kv_pool,
                         step.logits_rows)[row].clone()  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_rows_logits_are_the_same_bits_in_batches_of_1_3_8_and_16(tiny_llama_dir, threads):
    """The row alone, then first, in the middle and last of batches of 3, 8 and 16, on the
    fused decode kernel and operation by operation: one set of bits."""
    engine = deterministic_engine(tiny_llama_dir, num_threads=threads)
    seqs = decode_ready(engine, LENGTHS)
    torch.set_num_threads(threads)
    target, others = seqs[0], seqs[1:]
    expected = decode_row(engine, [target], 0, fused=True)
    for size in (1, 3, 8, 16):
        for place in sorted({0, size // 2, size - 1}):
            batch = [*others[:place], target, *others[place : size - 1]]
            for fused in (True, False):
                got = decode_row(engine, batch, place, fused)
                assert torch.equal(got, expected), (size, place, fused)
    for seq in seqs:
        engine.abort(seq.request_id)
    assert_no_leaks(engine)


def test_the_default_kernels_rows_do_depend_on_their_batch(tiny_llama_dir):
    """Why the mode exists, and proof that the comparison above can fail: off, a single
    row streams its weights on two chains and long rows split into spans at small
    batches, so the same row gets other bits alone than in a batch of 16."""
    engine = make_engine(tiny_llama_dir, num_kv_blocks=512)
    seqs = decode_ready(engine, LENGTHS)
    alone = decode_row(engine, seqs[:1], 0, fused=True)
    in_batch = decode_row(engine, seqs, 0, fused=True)
    assert not torch.equal(alone, in_batch)
    for seq in seqs:
        engine.abort(seq.request_id)
    assert_no_leaks(engine)


# --- the attention kernels ---------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels_by_width():
    """The kernels built at 8 and at 16 floats per vector (as tests/test_engine_paths.py
    builds them: GCC pairs ymm halves where the CPU has no AVX-512F)."""
    built = {}
    with pytest.MonkeyPatch.context() as patch:
        for lanes in (8, 16):
            patch.setenv("PDSERVE_KERNEL_VECTOR_WIDTH", str(lanes))
            built[lanes] = NativeKernels(ctypes.CDLL(str(build_library())))
    return built


def paged_rows(lengths, group, head_dim, pool_dtype, block_size=16, num_kv_heads=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    pool = torch.randn(len(lengths) * width + 1, 2, block_size, num_kv_heads, head_dim,
                       generator=generator).to(pool_dtype)  # fmt: skip
    tables = torch.randperm(pool.shape[0], generator=generator)[: len(lengths) * width]
    q = torch.randn(len(lengths), num_kv_heads * group * head_dim, generator=generator)
    return q, pool, tables.view(len(lengths), width).contiguous()


def kernel_decode(kernels, q, pool, tables, lengths, threads):
    rows = q.shape[0]
    num_kv_heads, head_dim = pool.shape[3], pool.shape[4]
    out = torch.empty_like(q)
    lens = torch.tensor(lengths, dtype=torch.int64)
    status = kernels.decode_attention(
        q=q.data_ptr(), ldq=q.stride(0), R=rows, Hq=q.shape[1] // head_dim, Hkv=num_kv_heads,
        D=head_dim, k_cache=pool[:, 0].data_ptr(), v_cache=pool[:, 1].data_ptr(),
        block_stride=pool.stride(0), block_size=pool.shape[2], block_tables=tables.data_ptr(),
        table_stride=tables.stride(0), context_lens=lens.data_ptr(), scale=head_dim**-0.5,
        out=out.data_ptr(), ldo=out.stride(0), nthreads=threads,
        kv_bf16=int(pool.dtype == torch.bfloat16), deterministic=1,
    )  # fmt: skip
    assert status == 0
    return out


def kernel_prefill_last_row(kernels, q_row, pool, table, length, context_start, threads):
    """`q_row` as the last row of a prefill chunk [context_start, length) of one sequence."""
    head_dim = pool.shape[4]
    generator = torch.Generator().manual_seed(length + context_start)
    rows = torch.randn(length - context_start, q_row.shape[0], generator=generator)
    rows[-1] = q_row
    out = torch.empty_like(rows)
    status = kernels.prefill_attention(
        q=rows.data_ptr(), ldq=rows.stride(0), T=rows.shape[0], Hq=q_row.shape[0] // head_dim,
        Hkv=pool.shape[3], D=head_dim, k_cache=pool[:, 0].data_ptr(),
        v_cache=pool[:, 1].data_ptr(), block_stride=pool.stride(0), block_size=pool.shape[2],
        table=table.data_ptr(), context_start=context_start, scale=head_dim**-0.5,
        out=out.data_ptr(), ldo=out.stride(0), nthreads=threads,
        kv_bf16=int(pool.dtype == torch.bfloat16),
    )  # fmt: skip
    assert status == 0
    return out[-1]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (4, 32), (6, 16), (9, 128)])
def test_a_deterministic_decode_row_is_a_prefill_rows_bits_at_either_vector_width(
    kernels_by_width, group, head_dim, pool_dtype
):
    """pd_decode_attention in deterministic mode, on rows of 300, 41, 16 and 1 tokens in
    one batch and alone, on 1 and 2 threads, against pd_prefill_attention's last row of
    chunks of 1, 7 and the whole row: one set of bits, at 8 and at 16 floats per vector.
    Every group size (more than EXACT_HEADS query heads per kv head, too) and a bf16 pool."""
    lengths = [300, 41, 16, 1]
    q, pool, tables = paged_rows(lengths, group, head_dim, pool_dtype)
    expected = None
    for kernels in kernels_by_width.values():
        batch = kernel_decode(kernels, q, pool, tables, lengths, threads=2)
        for row, length in enumerate(lengths):
            alone = kernel_decode(kernels, q[row : row + 1], pool, tables[row : row + 1],
                                  [length], threads=1)  # fmt: skip
            assert torch.equal(alone[0], batch[row]), row
            for chunk in {1, 7, length}:
                if chunk <= length:
                    prefill = kernel_prefill_last_row(kernels, q[row], pool, tables[row],
                                                      length, length - chunk, threads=2)  # fmt: skip
                    assert torch.equal(prefill, batch[row]), (row, chunk)
        expected = batch if expected is None else expected
        assert torch.equal(batch, expected)


# --- seeded streams ----------------------------------------------------------------------


def test_seeded_streams_one_at_a_time_all_at_once_and_among_greedy_ones_match(tiny_llama_dir):
    """16 seeded streams at temperature 0.8: alone, all at once, and mixed with 8
    unrelated greedy streams give the same tokens from the same logits, bit for bit."""
    engine = deterministic_engine(tiny_llama_dir)
    requests = seeded_requests()
    ids = [rid for rid, _, _ in requests]
    alone_tokens, alone_logits = run_one_at_a_time(engine, requests)

    together_tokens, together_logits = run_together(engine, requests)
    greedy = [(f"g{i}", prompt_of(30 + 7 * i, salt=50 + i), GREEDY) for i in range(8)]
    interleaved = [item for pair in zip(requests[:8], greedy, strict=True) for item in pair]
    mixed_tokens, mixed_logits = run_together(engine, interleaved + requests[8:])

    assert together_tokens == alone_tokens
    assert {rid: mixed_tokens[rid] for rid in ids} == alone_tokens
    assert_same_bits(alone_logits, together_logits, ids)
    assert_same_bits(alone_logits, mixed_logits, ids)


def test_with_the_mode_off_the_same_batch_gives_the_same_output(tiny_llama_dir):
    """The promise without the mode: the same requests in the same batch, in a fresh
    engine, give the same seeded tokens from the same logits."""
    first_tokens, first_logits = run_together(make_engine(tiny_llama_dir, num_kv_blocks=512),
                                              seeded_requests())  # fmt: skip
    again_tokens, again_logits = run_together(make_engine(tiny_llama_dir, num_kv_blocks=512),
                                              seeded_requests())  # fmt: skip
    assert again_tokens == first_tokens
    assert_same_bits(first_logits, again_logits, first_tokens)


def test_a_stream_recomputed_from_its_decided_tokens_continues_with_the_same_bits(
    tiny_llama_dir,
):
    """What a migrated stream goes through: its prompt and the tokens decided so far are
    prefilled again (here in 16-token chunks, elsewhere from the prefix cache) and
    decoding continues from the same seed. The logits of the steps after the resume
    equal those of the uninterrupted decode steps, bit for bit."""
    params = SamplingParams(max_tokens=14, temperature=0.8, seed=7, ignore_eos=True)
    prompt = prompt_of(70, salt=3)
    engine = deterministic_engine(tiny_llama_dir, prefill_chunk_size=16, max_batch_tokens=64)
    tokens, logits = run_together(engine, [("whole", prompt, params)])
    for decided in (1, 6, 13):
        resumed = deterministic_engine(tiny_llama_dir, prefill_chunk_size=16, max_batch_tokens=64)
        with recorded_logits(resumed) as seen:
            seq = resumed.add_request(
                "resumed", prompt, params, output_token_ids=tokens["whole"][:decided]
            )
            while resumed.has_unfinished():
                resumed.step()
        assert seq.output_token_ids == tokens["whole"], decided
        assert_same_bits({"resumed": logits["whole"][decided:]}, seen, ["resumed"])
        assert_no_leaks(resumed)


# --- chunking and the prefix cache -------------------------------------------------------

PROMPT_LEN = 61


def prompt_kv_and_logits(engine, prompt, request_id="p"):
    """The pool's keys and values of every prompt position (all layers) and the logits the
    first token was drawn from, read before the blocks go back to the pool."""
    captured = {}
    run = engine.runner.run

    def capturing(chunks):
        result = run(chunks)
        for seq, row in zip(result.sampling_seqs, result.logits, strict=True):
            if seq.request_id == request_id and not seq.output_token_ids:
                blocks = engine.kv_pool.read_blocks(seq.block_ids).clone()
                captured["kv"], captured["logits"] = blocks, row.clone()
        return result

    engine.runner.run = capturing
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    engine.runner.run = run
    assert_no_leaks(engine)
    return _positions(captured["kv"], len(prompt)), captured["logits"]


def _positions(blocks: torch.Tensor, count: int) -> torch.Tensor:
    """[blocks, layers, 2, block_size, ...] -> [positions, layers, 2, ...], first `count`."""
    return blocks.movedim(3, 1).flatten(0, 1)[:count]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("chunk", [PROMPT_LEN, 16, 20, 7])
def test_prefill_in_any_chunks_gives_the_same_kv_and_logits(tiny_llama_dir, chunk, kv_cache_dtype):
    """One chunk, four of 16 (the last 13), 20 (the last a lone token, which runs as a
    decode row), or nine of 7, over a float32 or a bf16 pool: the prompt's KV and its
    logits are the same bits."""
    prompt = prompt_of(PROMPT_LEN, salt=11)
    sizes = dict(max_batch_tokens=64, kv_cache_dtype=kv_cache_dtype)
    reference = deterministic_engine(tiny_llama_dir, prefill_chunk_size=64, **sizes)
    expected_kv, expected_logits = prompt_kv_and_logits(reference, prompt)
    engine = deterministic_engine(tiny_llama_dir, prefill_chunk_size=chunk, **sizes)
    kv, logits = prompt_kv_and_logits(engine, prompt)
    assert torch.equal(kv, expected_kv)
    assert torch.equal(logits, expected_logits)


@pytest.mark.parametrize("cached_tokens", [32, 56])
def test_a_prompt_half_from_the_prefix_cache_gives_the_same_kv_and_logits(
    tiny_llama_dir, cached_tokens
):
    """The first blocks come from an earlier request's KV (computed in its own chunks),
    the rest (25 tokens, or a lone one, which runs as a decode row) is computed after
    them: the same bits as the whole prompt in one chunk."""
    prompt = prompt_of(57, salt=11)
    reference = deterministic_engine(tiny_llama_dir, prefill_chunk_size=64, max_batch_tokens=64)
    expected_kv, expected_logits = prompt_kv_and_logits(reference, prompt)
    engine = deterministic_engine(tiny_llama_dir, prefill_chunk_size=24, max_batch_tokens=64)
    engine.generate([prompt[:cached_tokens]], SamplingParams(max_tokens=1, temperature=0.0))
    kv, logits = prompt_kv_and_logits(engine, prompt)
    assert engine.cache_report().hit_tokens >= cached_tokens
    assert torch.equal(kv, expected_kv)
    assert torch.equal(logits, expected_logits)


# --- the sampler --------------------------------------------------------------------------


def test_a_seeded_rows_draw_does_not_depend_on_the_rows_beside_it():
    """The sampler's softmax, truncation and draw run per row: a seeded row at
    temperature 0.8 (plain, top-k, top-p) draws the same token with the same logprobs
    alone and among greedy, unseeded and truncated rows."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4096, generator=generator) * 4
    rows = [
        SamplingParams(temperature=0.8, seed=1, logprobs=2),
        SamplingParams(temperature=0.8, seed=2, top_k=40, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, top_p=0.9, logprobs=2),
    ]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.5, seed=9),
        SamplingParams(temperature=1.2, top_k=5),
    ]
    for index, params in enumerate(rows):
        alone = Sampler().run(logits[index : index + 1], [params], [5])
        batch = [*others[:2], params, *others[2:], *others]
        batch_logits = torch.cat([logits[4:6], logits[index : index + 1], logits[6:12]])
        together = Sampler().run(batch_logits, batch, [5] * len(batch))
        assert together.tokens[2] == alone.tokens[0]
        assert together.logprobs[2] == alone.logprobs[0]


# --- greedy parity and configuration ------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_output_equals_transformers_in_both_modes(tiny_model_dirs, family, deterministic):
    model_dir = tiny_model_dirs[family]
    engine = make_engine(model_dir, deterministic=deterministic, prefill_chunk_size=16)
    prompts = [prompt_of(n, salt=5) for n in (3, 17, 40)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))  # fmt: skip
    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, prompt, 12)[0]
    assert_no_leaks(engine)


@pytest.mark.demo
@pytest.mark.parametrize("deterministic", [False, True])
def test_demo_greedy_equals_transformers_in_both_modes(deterministic):
    demo_dir = prepare_demo_model()
    engine = make_engine(demo_dir, block_size=16, num_kv_blocks=128, deterministic=deterministic)
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions
    ]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                      ignore_eos=True))  # fmt: skip
    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_token_ids == hf_greedy(demo_dir, prompt, 16)[0]
    assert_no_leaks(engine)


def test_the_mode_refuses_paths_whose_rows_depend_on_their_batch(tiny_llama_dir, monkeypatch):
    """Torch attention (SDPA over gathered blocks) and torch layer ops on a CPU without
    Triton's interpreter have no batch-invariant form: asking for them raises at load."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="deterministic mode needs attention_backend"):
        make_engine(tiny_llama_dir, deterministic=True, attention_backend="torch")
    with pytest.raises(ValueError, match="deterministic mode cannot run torch layer ops"):
        make_engine(tiny_llama_dir, deterministic=True, kernels="torch")
    with pytest.raises(ValueError, match="deterministic must be true or false"):
        EngineConfig(deterministic="yes")
