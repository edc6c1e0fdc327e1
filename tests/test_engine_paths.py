"""Every execution path of the forward agrees: native CPU kernels, torch ops, each
attention backend available here; float32 greedy output equals transformers' on each."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch
import torch.nn.functional as F

from engine.attention import (
    AttentionMetadata,
    PrefillChunk,
    TorchPagedAttention,
    make_attention_backend,
)
from engine.layer_ops import Linear
from engine.model import LlamaForward
from engine.native.attention import NativePagedAttention
from engine.native.build import build_library
from engine.native.ops import (
    DECODE_PHASES,
    PROLOGUE_NONE,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    NativeKernels,
    NativeOps,
    native_kernels,
)
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from tests.factories import assert_no_leaks, hf_greedy, make_engine, prompt_of

needs_native = pytest.mark.skipif(native_kernels() is None, reason="no C compiler here")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def with_kernels(engine, kernels: str, attention: str = "auto"):
    """The same engine, its forward rebuilt on another kernel set / attention backend."""
    engine.rebuild_model(kernels=kernels, attention=attention)
    return engine


def reference_linear(x, projection: Linear, prologue, norm_weight, eps, bf16: bool = False):
    """The projection in float64. With `bf16`, as the kernels' bf16 mode computes it: the
    prologue in float32, its output and the weight rounded to bf16, the sums in float64."""
    x, norm_weight = (
        (x.float(), norm_weight.float()) if bf16 else (x.double(), norm_weight.double())
    )
    if prologue == PROLOGUE_RMSNORM:
        x = F.rms_norm(x, (x.shape[-1],), norm_weight, eps)
    elif prologue == PROLOGUE_SILU_MUL:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    weight = projection.weight
    if bf16:
        x, weight = x.bfloat16(), weight.bfloat16()
    bias = None if projection.bias is None else projection.bias.double()
    return F.linear(x.double(), weight.double(), bias)


def projection_case(rows, in_features, out_features, prologue, seed):
    """Inputs (twice as wide for SiLU*mul), a biased projection, RMSNorm weights and the
    output's starting values (the kernels accumulate into it), all from one seed."""
    generator = torch.Generator().manual_seed(seed)
    width = 2 * in_features if prologue == PROLOGUE_SILU_MUL else in_features
    x = torch.randn(rows, width, generator=generator)
    projection = Linear(
        torch.randn(out_features, in_features, generator=generator),
        torch.randn(out_features, generator=generator),
    )
    norm_weight = torch.rand(in_features, generator=generator) + 0.5
    start = torch.randn(rows, out_features, generator=generator)
    return x, projection, norm_weight, start


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 20])
@pytest.mark.parametrize("out_features", [37, 96])
@pytest.mark.parametrize("prologue", [PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU_MUL])
def test_native_linear_matches_float64(rows, out_features, prologue):
    """Every tile height, a strip tail (37 columns), bias, accumulate, both prologues."""
    in_features = 300 if prologue != PROLOGUE_SILU_MUL else 150
    seed = rows * 100 + out_features + prologue
    x, projection, norm_weight, start = projection_case(
        rows, in_features, out_features, prologue, seed
    )
    ops = NativeOps(native_kernels(), eps=1e-5)
    packed = ops.prepare_linear(projection)
    out = start.clone()

    ops._linear(x, packed, out, prologue, norm_weight, accumulate=True)

    expected = start.double() + reference_linear(x, projection, prologue, norm_weight, 1e-5)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("prologue", [PROLOGUE_NONE, PROLOGUE_RMSNORM])
def test_a_small_batchs_rows_get_the_bits_they_get_in_a_large_one(threads, prologue):
    """Two to four rows stream several strips at once (linear.c's few-rows path), eight
    run the register tiles: every column sums in the same order either way."""
    x, projection, norm_weight, start = projection_case(8, 300, 16 * 13 + 5, prologue, 7)
    ops = NativeOps(native_kernels(), eps=1e-5)
    ops.threads = threads
    packed = ops.prepare_linear(projection)
    large = start.clone()
    ops._linear(x, packed, large, prologue, norm_weight, accumulate=True)
    for rows in (2, 3, 4):
        small = start[:rows].clone()
        ops._linear(x[:rows], packed, small, prologue, norm_weight, accumulate=True)
        assert torch.equal(small, large[:rows]), rows


@pytest.fixture(scope="module")
def kernels_by_width():
    """The kernels built at 8 and at 16 floats per vector, once per module, in the kernel
    cache (the CPU's own width is usually there already). Where the CPU has no AVX-512F,
    GCC runs each 16-float vector as two 8-float ones: slower, the same arithmetic lane
    by lane, so the width checks below hold on every machine, and the 16-wide code is
    tested where it never serves."""
    if native_kernels() is None:
        pytest.skip("no C compiler here")
    built = {}
    with pytest.MonkeyPatch.context() as patch:
        for lanes in (8, 16):
            patch.setenv("PDSERVE_KERNEL_VECTOR_WIDTH", str(lanes))
            built[lanes] = NativeKernels(ctypes.CDLL(str(build_library())))
    return built


@pytest.mark.parametrize("prologue", [PROLOGUE_NONE, PROLOGUE_SILU_MUL])
def test_both_vector_widths_give_the_same_projection_bits(kernels_by_width, prologue):
    """One lane per output column, K summed in the same order: the kernels' vector width
    (8 or 16 floats, chosen by the build from the CPU) changes speed, not results."""
    generator = torch.Generator().manual_seed(7 + prologue)
    in_features = 576
    width = 2 * in_features if prologue == PROLOGUE_SILU_MUL else in_features
    weight = torch.randn(96, in_features, generator=generator)
    inputs = {rows: torch.randn(rows, width, generator=generator) for rows in (1, 5, 16, 29)}
    results = []
    for lanes, kernels in kernels_by_width.items():
        assert kernels.strip == 2 * lanes
        ops = NativeOps(kernels, eps=1e-5)
        packed = ops.prepare_linear(Linear(weight, None))
        outs = {}
        for rows, x in inputs.items():
            outs[rows] = torch.zeros(rows, 96)
            ops._linear(x, packed, outs[rows], prologue, None, accumulate=False)
        results.append(outs)
    for rows in inputs:
        assert torch.equal(results[0][rows], results[1][rows]), rows


def needs_bf16_native() -> bool:
    kernels = native_kernels()
    return kernels is not None and kernels.bf16


@pytest.mark.skipif(
    native_kernels() is None or not native_kernels().bf16, reason="no AVX512-BF16 kernels here"
)
@pytest.mark.parametrize("rows", [1, 5, 16, 29, 33, 300])
@pytest.mark.parametrize("shape", [(576, 96), (301, 37)])
@pytest.mark.parametrize("prologue", [PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU_MUL])
@pytest.mark.parametrize("tiles", ["amx", "dot products"])
def test_bf16_linear_is_float64_over_bf16_inputs(rows, shape, prologue, tiles):
    """bf16 weights, inputs rounded to bf16 after the prologue, float32 sums: every tile
    height (AMX blocks of 32 rows and their tails, VDPBF16PS tiles), a strip tail, an odd
    K (its pad, which stays off the AMX tiles), bias and accumulate. The RMSNorm prologue
    computes in float32 in another order than torch, so an input can round to the next
    bf16 now and then: a looser bound there."""
    kernels = native_kernels()
    if tiles == "amx" and not kernels.amx:
        pytest.skip("no AMX tiles here")
    in_features, out_features = shape
    x, projection, norm_weight, start = projection_case(
        rows, in_features, out_features, prologue, rows + in_features + prologue
    )
    ops = NativeOps(kernels, eps=1e-5, weights_bf16=True)
    packed = ops.prepare_linear(projection)
    out = start.clone()

    kernels.use_amx(wanted=int(tiles == "amx"))
    try:
        ops._linear(x, packed, out, prologue, norm_weight, accumulate=True)
    finally:
        kernels.use_amx(wanted=int(kernels.amx))

    reference = reference_linear(x, projection, prologue, norm_weight, 1e-5, bf16=True)
    expected = start.double() + reference
    atol = 0.05 if prologue == PROLOGUE_RMSNORM else 1e-3
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=1e-5)
    ids = torch.tensor([0, 3, out_features - 1])
    assert torch.equal(packed.rows(ids), projection.weight[ids].bfloat16().float())


@needs_native
def test_packed_lm_head_serves_the_tied_embedding(tiny_model_dirs):
    engine = make_engine(tiny_model_dirs["qwen2"])
    weights = engine.model.weights
    assert weights.embed is weights.lm_head
    ids = torch.tensor([0, 5, 17, 383, 5])
    dense = weights.lm_head.packed.transpose(1, 2).reshape(-1, weights.lm_head.in_features)
    assert torch.equal(engine.model.ops.embed(ids, weights.embed), dense[ids])


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_each_kernel_set_matches_transformers(tiny_model_dirs, family, kernels):
    if kernels == "native" and native_kernels() is None:
        pytest.skip("no C compiler here")
    model_dir = tiny_model_dirs[family]
    engine = with_kernels(make_engine(model_dir), kernels)
    assert engine.model.ops.name == kernels
    prompts = [prompt_of(n, salt=5) for n in (7, 30)]

    outputs = engine.generate(prompts, GREEDY)

    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, prompt, 24)[0]
    assert_no_leaks(engine)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_chunked_prefill_after_context_matches_one_shot(tiny_llama_dir, kernels):
    """Chunks after cached context gather it (pd_gather_kv or index_select)."""
    if kernels == "native" and native_kernels() is None:
        pytest.skip("no C compiler here")
    one_shot = with_kernels(make_engine(tiny_llama_dir), kernels)
    chunked = with_kernels(
        make_engine(tiny_llama_dir, prefill_chunk_size=7, max_batch_tokens=16), kernels
    )
    prompts = [prompt_of(n, salt=6) for n in (9, 30)]

    expected = [s.output_token_ids for s in one_shot.generate(prompts, GREEDY)]
    actual = [s.output_token_ids for s in chunked.generate(prompts, GREEDY)]

    assert actual == expected
    assert_no_leaks(chunked)


@needs_native
def test_chunked_prefill_over_a_bf16_pool_matches_one_shot(tiny_llama_dir):
    """rope_store rounds a chunk's keys as it stores them, so the chunk attends to what
    later chunks and decode steps read back from the pool: splitting changes nothing."""
    one_shot = engine_with_kv(tiny_llama_dir, "bfloat16")
    chunked = engine_with_kv(tiny_llama_dir, "bfloat16", prefill_chunk_size=7, max_batch_tokens=16)
    assert one_shot.kv_pool.kv.dtype == torch.bfloat16
    prompts = [prompt_of(n, salt=6) for n in (9, 30)]

    expected = [s.output_token_ids for s in one_shot.generate(prompts, GREEDY)]
    actual = [s.output_token_ids for s in chunked.generate(prompts, GREEDY)]

    assert actual == expected
    assert_no_leaks(chunked)


def test_the_kv_pool_takes_the_models_dtype_unless_told(tiny_llama_dir):
    """`auto` is the weights' dtype (bf16 KV under the native kernels' float32
    activations too); a KV dtype apart from the activations' needs the native kernels."""
    bf16 = make_engine(tiny_llama_dir, dtype="bfloat16")
    assert bf16.kv_pool.kv.dtype == torch.bfloat16
    assert bf16.layout.block_nbytes == 2 * bf16.layout.block_numel
    assert make_engine(tiny_llama_dir).kv_pool.kv.dtype == torch.float32
    with pytest.raises(ValueError, match="native CPU kernels"):
        make_engine(tiny_llama_dir, dtype="bfloat16", kernels="torch", kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine(tiny_llama_dir, kv_cache_dtype="int8")


def _decode_step_inputs(engine, lengths):
    """Prefill sequences of `lengths`, then the metadata of their next decode step."""
    for i, length in enumerate(lengths):
        engine.add_request(f"seq-{i}", prompt_of(length, salt=7), GREEDY)
    engine.step()
    chunks = [ScheduledChunk(seq, 1) for seq in engine.sequences.values()]
    for chunk in chunks:
        chunk.seq.block_ids += engine.allocator.allocate(1, chunk.seq.request_id)
    return chunks


def available_backends(dtype: torch.dtype) -> list[str]:
    names = []
    for name in ("torch", "native", "flash"):
        try:
            make_attention_backend(name, dtype, "cpu")
        except ValueError:
            continue
        names.append(name)
    return names


def engine_with_kv(model_dir, kv_cache_dtype: str, **overrides):
    """A float32 engine whose pool holds `kv_cache_dtype` (bf16 KV needs the native kernels)."""
    if kv_cache_dtype == "bfloat16" and native_kernels() is None:
        pytest.skip("a bf16 pool under float32 activations needs the native kernels")
    return make_engine(model_dir, kv_cache_dtype=kv_cache_dtype, **overrides)


KV_DTYPES = pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])


@KV_DTYPES
@pytest.mark.parametrize(
    "lengths",
    [[5, 8, 17, 30], [70, 140], [300]],
    ids=["one-span-each", "two-spans-each", "four-spans"],  # the native plan, 8-token blocks
)
def test_every_available_attention_backend_agrees_on_a_decode_step(
    tiny_llama_dir, kv_cache_dtype, lengths
):
    """Over a float32 pool, and a bf16 one (read back exactly: only the sums' order differs);
    long sequences split into spans whose partial softmaxes the native kernel merges."""
    engine = engine_with_kv(tiny_llama_dir, kv_cache_dtype)
    chunks = _decode_step_inputs(engine, lengths)
    assert [c.seq.num_computed_tokens for c in chunks] == lengths
    meta = engine.runner.build_step(chunks).meta
    spec = engine.spec
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(len(chunks), spec.num_heads, spec.head_dim, generator=generator)
    new_kv = torch.randn(len(chunks), spec.num_kv_heads, spec.head_dim, generator=generator)
    engine.kv_pool.write_slots(1, meta.slot_blocks, meta.slot_offsets, new_kv, -new_kv)
    scale = spec.head_dim**-0.5

    reference = TorchPagedAttention().forward(q, new_kv, -new_kv, engine.kv_pool, 1, meta, scale)
    backends = available_backends(torch.float32)
    assert "torch" in backends
    for name in backends:
        backend = make_attention_backend(name, torch.float32, "cpu")
        out = backend.forward(q, new_kv, -new_kv, engine.kv_pool, 1, meta, scale)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5, msg=name)
    for chunk in chunks:
        engine.abort(chunk.seq.request_id)
    assert_no_leaks(engine)


def _native_decode_attention(
    q, pool, tables, context_lens, threads: int, deterministic: bool = False
) -> torch.Tensor | None:
    """pd_decode_attention over `pool` [blocks, 2 (keys, values), block_size, Hkv, D];
    None where the kernel declines the shapes."""
    rows, num_heads, head_dim = q.shape
    out = torch.empty(rows, num_heads * head_dim)
    keys, values = pool[:, 0], pool[:, 1]
    status = native_kernels().decode_attention(
        q.data_ptr(), num_heads * head_dim, rows, num_heads, pool.shape[3], head_dim,
        keys.data_ptr(), values.data_ptr(), pool.stride(0), pool.shape[2],
        tables.data_ptr(), tables.stride(0), context_lens.data_ptr(), head_dim**-0.5,
        out.data_ptr(), num_heads * head_dim, threads, int(pool.dtype == torch.bfloat16),
        int(deterministic),
    )  # fmt: skip
    return out.view(rows, num_heads, head_dim) if status == 0 else None


@needs_native
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("group", "head_dim"),
    [(1, 64), (2, 64), (3, 64), (3, 24), (4, 64), (5, 32), (6, 64), (7, 16), (8, 64), (12, 64)],
)
def test_native_decode_attention_scores_each_group_of_heads_over_its_kv_head(
    group, head_dim, pool_dtype, deterministic
):
    """Keys are scored a group of query heads at a time, tiled by group size: every
    group size, head dims that do and do not fill the value pass's wide tiles, and
    blocks cut short, against softmax(q k^T) v over the pool read back as float32; the
    result's bits do not depend on the thread count. Deterministic mode (a prefill row's
    arithmetic) takes head dims of multiples of 16 and declines the others."""
    num_kv_heads, block_size, lengths = 2, 16, [5, 16, 21, 40, 151]
    num_heads, blocks_each = group * num_kv_heads, -(-max(lengths) // block_size)
    generator = torch.Generator().manual_seed(group * 100 + head_dim)
    pool = torch.randn(len(lengths) * blocks_each, 2, block_size, num_kv_heads, head_dim,
                       generator=generator).to(pool_dtype)  # fmt: skip
    order = torch.randperm(pool.shape[0], generator=generator)
    tables = order.view(len(lengths), blocks_each).contiguous()
    context_lens = torch.tensor(lengths, dtype=torch.int64)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator)

    out = _native_decode_attention(q, pool, tables, context_lens, 2, deterministic)
    one_thread = _native_decode_attention(q, pool, tables, context_lens, 1, deterministic)
    if deterministic and head_dim % 16:
        assert out is None and one_thread is None
        return
    assert torch.equal(out, one_thread)
    for row, length in enumerate(lengths):
        tokens = pool[tables[row]].float().transpose(1, 2).reshape(-1, 2, num_kv_heads, head_dim)
        keys, values = (tokens[:length, kind].repeat_interleave(group, dim=1) for kind in (0, 1))
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[row], keys) * head_dim**-0.5, -1)
        expected = torch.einsum("ht,thd->hd", weights, values)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)


def _prefill_chunk_case(engine, context_start: int, query_len: int):
    """A chunk of `query_len` rows after `context_start` cached tokens, its keys and
    values in layer 1 of the pool, behind 2 decode rows in the packed batch. Returns the
    forward's arguments (q, k, v, meta, scale), the chunk's rows and its blocks."""
    spec, block_size = engine.spec, engine.config.block_size
    length = context_start + query_len
    blocks = engine.allocator.allocate(-(-length // block_size), "chunk")
    table = torch.tensor(blocks, dtype=torch.int64)
    positions = torch.arange(length)
    slot_blocks, slot_offsets = table[positions // block_size], positions % block_size
    generator = torch.Generator().manual_seed(4)
    keys, values = (
        torch.randn(length, spec.num_kv_heads, spec.head_dim, generator=generator) for _ in range(2)
    )
    engine.kv_pool.write_slots(1, slot_blocks, slot_offsets, keys, values)
    decode_rows = 2
    q = torch.randn(decode_rows + query_len, spec.num_heads, spec.head_dim, generator=generator)
    new = slice(context_start, length)
    chunk = PrefillChunk(decode_rows, query_len, context_start, table)
    meta = AttentionMetadata(slot_blocks[new], slot_offsets[new], prefill_chunks=[chunk])
    padded_k, padded_v = (
        torch.cat([torch.zeros(decode_rows, *t.shape[1:]), t[new]]) for t in (keys, values)
    )
    return (q, padded_k, padded_v, meta, spec.head_dim**-0.5), slice(decode_rows, None), blocks


@pytest.mark.parametrize(
    ("context_start", "query_len"),
    # tails of the 6- and 12-row tiles (8- and 16-float builds), block edges
    [(0, 1), (0, 7), (0, 45), (9, 13), (32, 20)],
)
@KV_DTYPES
def test_every_available_attention_backend_agrees_on_a_prefill_chunk(
    tiny_llama_dir, context_start, query_len, kv_cache_dtype
):
    """A chunk attends causally to its cached context and itself, read from the pool."""
    engine = engine_with_kv(tiny_llama_dir, kv_cache_dtype)
    (q, k, v, meta, scale), rows, blocks = _prefill_chunk_case(engine, context_start, query_len)
    # the chunk's own keys as the pool holds them (what rope_store leaves in qkv)
    k, v = (t.to(engine.kv_pool.kv.dtype).float() for t in (k, v))

    reference = TorchPagedAttention().forward(q, k, v, engine.kv_pool, 1, meta, scale)
    for name in available_backends(torch.float32):
        backend = make_attention_backend(name, torch.float32, "cpu")
        out = backend.forward(q, k, v, engine.kv_pool, 1, meta, scale)
        torch.testing.assert_close(out[rows], reference[rows], atol=1e-5, rtol=1e-5, msg=name)
    engine.allocator.free(blocks)
    assert_no_leaks(engine)


@KV_DTYPES
@pytest.mark.parametrize(("context_start", "query_len"), [(9, 45), (0, 67)])
def test_both_vector_widths_give_the_same_prefill_attention_bits(
    tiny_llama_dir, kernels_by_width, kv_cache_dtype, context_start, query_len
):
    """Each lane sums its score or value column in the same order at 8 or 16 floats,
    whatever the tile's rows, and each softmax row its exponentials in the same order
    whatever the length of its causal prefix: the width changes speed, not results."""
    engine = engine_with_kv(tiny_llama_dir, kv_cache_dtype)
    (q, k, v, meta, scale), rows, blocks = _prefill_chunk_case(engine, context_start, query_len)
    outs = []
    for kernels in kernels_by_width.values():
        backend = NativePagedAttention(kernels)
        outs.append(backend.forward(q, k, v, engine.kv_pool, 1, meta, scale)[rows])
    assert torch.equal(outs[0], outs[1])
    engine.allocator.free(blocks)
    assert_no_leaks(engine)


def test_decode_graphs_pad_to_buckets_and_write_only_their_scratch_block(tiny_llama_dir):
    """The CUDA-graph runner run eagerly (`capture=False`): the start-up warm-ups of every
    bucket up to max_num_seqs write nothing but the scratch block; a padded step's real
    rows have the unpadded step's logits, and its padding row writes the scratch block,
    no other block but the real rows' own."""
    from engine.cuda_graphs import DecodeGraphs, batch_buckets, bucket_for, width_buckets

    engine = make_engine(tiny_llama_dir)
    chunks = _decode_step_inputs(engine, [5, 17, 30])
    step = engine.runner.build_step(chunks)
    (scratch,) = engine.allocator.allocate(1, "scratch")
    graphs = DecodeGraphs(engine.model, engine.kv_pool, scratch, capture=False)
    assert bucket_for(3, (1, 2, 4)) == 4 and bucket_for(5, (1, 2, 4)) is None
    assert width_buckets(6) == (1, 2, 4, 6) and batch_buckets(3) == (1, 2, 4)
    pool = engine.kv_pool.kv
    before = pool.clone()

    graphs.capture_all(max_num_seqs=3)

    assert set(graphs.steps) == {(b, w) for b in (1, 2, 4) for w in graphs.widths}
    assert _changed_blocks(before, pool) == {scratch}
    expected = engine.model.forward(
        step.input_ids, step.positions, step.meta, engine.kv_pool, step.logits_rows
    )
    pool[scratch] = 0
    before = pool.clone()
    assert graphs.covers(step)
    padded = graphs.run(step)

    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)
    real_blocks = set(step.meta.slot_blocks.tolist())
    assert scratch in _changed_blocks(before, pool) <= real_blocks | {scratch}
    engine.allocator.free([scratch])
    for chunk in chunks:
        engine.abort(chunk.seq.request_id)
    assert_no_leaks(engine)


def _changed_blocks(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    differs = (before != after).flatten(1).any(dim=1)
    return set(differs.nonzero().flatten().tolist())


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_step_matches_per_operation_path_on_any_thread_count(tiny_llama_dir, dtype):
    """A decode-only step runs as one native call; its logits match the operation-by-
    operation path, and are bit-identical on one thread and on two (bf16 weights too,
    where the CPU runs them natively)."""
    if dtype == "bfloat16" and not needs_bf16_native():
        pytest.skip("bf16 runs on torch here (no AVX512-BF16, or AMX)")
    engine = make_engine(tiny_llama_dir, dtype=dtype)
    chunks = _decode_step_inputs(engine, [5, 17, 30])
    step = engine.runner.build_step(chunks)
    model = engine.model
    assert model.fused_decode is not None
    assert model.weights.lm_head.bf16 == (dtype == "bfloat16")

    def logits(threads: int, fused: bool) -> torch.Tensor:
        previous, saved = torch.get_num_threads(), model.fused_decode
        torch.set_num_threads(threads)
        model.fused_decode = saved if fused else None
        try:
            return model.forward(
                step.input_ids, step.positions, step.meta, engine.kv_pool, step.logits_rows
            )
        finally:
            torch.set_num_threads(previous)
            model.fused_decode = saved

    one, two = logits(1, fused=True), logits(2, fused=True)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, logits(1, fused=False), atol=1e-4, rtol=1e-5)
    for chunk in chunks:
        engine.abort(chunk.seq.request_id)
    assert_no_leaks(engine)


@needs_native
def test_fused_decode_buffers_kept_from_a_larger_step_give_the_same_logits(tiny_llama_dir):
    """The fused step keeps its scratch, logits and int buffers at the most rows it has
    seen; a smaller step after a larger one computes exactly what a fresh instance does,
    and its greedy tokens are numpy's argmax of its logits."""
    from engine.native.decode_step import FusedDecode

    engine = make_engine(tiny_llama_dir)
    chunks = _decode_step_inputs(engine, [5, 17, 30])
    model, pool, runner = engine.model, engine.kv_pool, engine.runner
    kept = model.fused_decode
    wide = kept.run(runner.decode_rows(chunks), pool, 2)
    assert wide.greedy == wide.logits.numpy().argmax(axis=-1).tolist()
    reused = kept.run(runner.decode_rows(chunks[1:2]), pool, 2)
    fresh = FusedDecode(kept.kernels, model).run(runner.decode_rows(chunks[1:2]), pool, 2)
    assert torch.equal(reused.logits, fresh.logits)
    assert reused.greedy == fresh.greedy == wide.greedy[1:2]
    for chunk in chunks:
        engine.abort(chunk.seq.request_id)
    assert_no_leaks(engine)


@needs_native
def test_the_phase_clock_counts_every_fused_step_and_changes_no_logits(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """`pdserve bench engine --phases` builds the kernels with decode_step.c's phase clock:
    it counts each fused step, splits its time into the phases (within the time the calls
    took), starts again from zero once read, and leaves the logits' bits alone."""
    from engine.native.decode_step import FusedDecode

    engine = make_engine(tiny_llama_dir)
    chunks = _decode_step_inputs(engine, [5, 17, 30])
    model, pool, rows = engine.model, engine.kv_pool, engine.runner.decode_rows(chunks)
    plain = model.fused_decode
    assert plain.kernels.decode_phases() is None  # the default build has no clock
    monkeypatch.setenv("PDSERVE_KERNEL_PHASE_CLOCK", "1")
    clocked = NativeKernels(ctypes.CDLL(str(build_library(tmp_path))))
    timed = FusedDecode(clocked, model)

    start = time.perf_counter()
    steps = [timed.run(rows, pool, 2) for _ in range(3)]
    elapsed = time.perf_counter() - start
    seconds, count = clocked.decode_phases()

    assert count == 3 and tuple(seconds) == DECODE_PHASES
    assert min(seconds.values()) >= 0.0 and 0.0 < sum(seconds.values()) <= elapsed
    assert clocked.decode_phases() == (dict.fromkeys(DECODE_PHASES, 0.0), 0)
    assert torch.equal(steps[-1].logits, plain.run(rows, pool, 2).logits)
    for chunk in chunks:
        engine.abort(chunk.seq.request_id)
    assert_no_leaks(engine)


@needs_native
def test_engine_decode_steps_take_the_fused_kernel_with_the_forward_logits(tiny_llama_dir):
    """The engine's runner hands a decode-only step to the fused kernel as plain ints; its
    logits equal `forward`'s over the same step's tensors. A step where a row does not
    sample (a one-token prefill piece) is no fused step."""
    engine = make_engine(tiny_llama_dir)
    chunks = _decode_step_inputs(engine, [5, 17, 30])
    runner = engine.runner
    step = runner.build_step(chunks)
    expected = engine.model.forward(
        step.input_ids, step.positions, step.meta, engine.kv_pool, step.logits_rows
    )
    result = runner.run(chunks)
    assert result.greedy is not None
    assert torch.equal(result.logits, expected)
    assert result.sampling_seqs == [c.seq for c in chunks]
    behind = chunks[0].seq
    behind.num_computed_tokens -= 1
    assert runner.decode_rows(chunks) is None
    behind.num_computed_tokens += 1
    for chunk in chunks:
        engine.abort(chunk.seq.request_id)
    assert_no_leaks(engine)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_greedy_is_numpys_argmax_across_the_threads_columns(threads):
    """The fused step's greedy tokens come from each thread's columns, merged: the first
    of equal maxima wins across a thread boundary, a NaN wins over any number (the first
    NaN), a row of -inf gives 0, and the partial strip's columns count too."""
    kernels = native_kernels()
    vocab = 5 * kernels.strip + 3
    rows = torch.randn(6, vocab)
    rows[1, [7, vocab - 2]] = 50.0  # ties: the first one, whoever's columns hold them
    rows[2, vocab // 2 + 1] = float("nan")
    rows[2, vocab - 1] = float("nan")
    rows[3] = float("-inf")
    rows[4, vocab - 1] = 99.0  # in the partial strip
    rows[5, 3] = float("nan")
    rows[5, 4] = float("inf")
    tokens = (ctypes.c_int64 * rows.shape[0])()
    kernels.greedy_rows(
        x=rows.data_ptr(),
        rows=rows.shape[0],
        N=vocab,
        tokens=ctypes.addressof(tokens),
        nthreads=threads,
    )
    expected = [int(rows[0].argmax()), 7, vocab // 2 + 1, 0, vocab - 1, 3]
    assert list(tokens) == rows.numpy().argmax(axis=-1).tolist() == expected


def test_thread_choice_follows_the_faster_count_and_comes_back():
    """Quiet machine: two threads win. Busy sibling core: one thread wins within a
    retry, and two are not retried while the cores stay busy. Quiet again: two threads
    are back within LAST_RETRY steps."""
    from engine.threads import LAST_RETRY, ThreadChoice

    phase = {"busy": False}
    choice = ThreadChoice(2, idle_probe=lambda: 0.0 if phase["busy"] else 1.0)
    picked = []
    for step in range(4 * LAST_RETRY):
        phase["busy"] = LAST_RETRY <= step < 2 * LAST_RETRY
        threads = choice.pick(1)
        if phase["busy"]:
            seconds = 0.300 if threads == 2 else 0.030
        else:
            seconds = 0.018 if threads == 2 else 0.025
        choice.record(1, threads, seconds)
        picked.append(threads)

    quiet, busy = picked[:LAST_RETRY], picked[LAST_RETRY : 2 * LAST_RETRY]
    after = picked[-LAST_RETRY:]
    assert quiet.count(2) > 0.9 * len(quiet)
    assert busy.count(2) <= 1  # the one step that found the busy core
    assert after.count(2) > 0.9 * len(after)
    assert ThreadChoice(1).pick(16) == 1


def test_fewer_threads_are_not_retried_on_cores_nobody_else_wants():
    """Once two threads won on a quiet machine, one is tried again only after other
    processes kept a core busy: each try of a big step on one thread costs its steps."""
    from engine.threads import TRIAL_STEPS, ThreadChoice

    phase = {"others": 0.0}
    choice = ThreadChoice(2, idle_probe=lambda: choice.cores - phase["others"])
    picked = []
    for step in range(600):
        phase["others"] = 1.0 if step >= 400 else 0.0
        threads = choice.pick("mixed")
        choice.record("mixed", threads, {1: 0.78, 2: 0.46}[threads])
        picked.append(threads)
    assert picked[:400].count(1) == 0  # nobody else on the cores: not even a first try
    assert picked[400:].count(1) >= TRIAL_STEPS  # another process came: one is tried


def test_a_short_step_tries_fewer_threads_once_on_a_quiet_machine():
    """Where a second thread costs more in barriers than it gains (a tiny decode step),
    one thread is found even with nobody else on the cores, and kept."""
    from engine.threads import TRIAL_STEPS, ThreadChoice

    choice = ThreadChoice(2, idle_probe=lambda: choice.cores)  # quiet
    picked = []
    for _ in range(100):
        threads = choice.pick("decode")
        choice.record("decode", threads, {1: 0.010, 2: 0.014}[threads])
        picked.append(threads)
    assert picked[1 + TRIAL_STEPS : 1 + 2 * TRIAL_STEPS] == [1] * TRIAL_STEPS
    assert picked[1 + 2 * TRIAL_STEPS :].count(2) <= 2 * TRIAL_STEPS  # rare retries of two


def test_a_thread_counts_first_step_of_a_kind_does_not_decide():
    """The first step of a kind is cold (fresh pages) and not recorded: a slow first
    two-thread prefill must not put every later prefill on one thread."""
    from engine.threads import TRIAL_STEPS, ThreadChoice

    choice = ThreadChoice(2, idle_probe=lambda: 0.0)  # served: never idle
    picked = []
    for step in range(48):
        threads = choice.pick("prefill")
        choice.record("prefill", threads, 1.0 if step == 0 else {1: 0.9, 2: 0.5}[threads])
        picked.append(threads)
    explored = 1 + 2 * TRIAL_STEPS  # the cold step, then a try of each count
    assert picked[:explored] == [2] * (1 + TRIAL_STEPS) + [1] * TRIAL_STEPS
    assert picked[explored:].count(1) <= TRIAL_STEPS  # the occasional retry of one thread


def test_one_slow_step_does_not_move_the_thread_choice():
    """A try is judged by the median of its steps: a single slow one (a page fault, a
    burst of another process) among them does not hand the kind to the slower count."""
    from engine.threads import TRIAL_STEPS, ThreadChoice

    choice = ThreadChoice(2, idle_probe=lambda: 1.0)
    picked, twos = [], 0
    for _ in range(200):
        threads = choice.pick("prefill")
        if threads == 2:
            twos += 1
            seconds = 0.29 if twos == 2 else 0.18  # the first recorded two-thread step is slow
        else:
            seconds = 0.25
        choice.record("prefill", threads, seconds)
        picked.append(threads)
    assert picked[1 + TRIAL_STEPS : 1 + 2 * TRIAL_STEPS] == [1] * TRIAL_STEPS
    assert picked[1 + 2 * TRIAL_STEPS :].count(1) <= 4 * TRIAL_STEPS


def test_free_cores_do_not_count_this_processes_own_threads():
    """The retry probe asks whether *other* processes left cores free: an engine busy
    with its own decode steps between two prefills still finds both cores free."""
    from engine.threads import CpuSample, free_cores

    before = CpuSample(idle=1000, total=5000, ours=300.0)
    ours_busy = CpuSample(idle=1010, total=5200, ours=480.0)  # 180 of 200 ticks ours
    other_busy = CpuSample(idle=1010, total=5200, ours=300.0)  # someone else's
    assert free_cores(before, ours_busy, 2) == pytest.approx(1.9)
    assert free_cores(before, other_busy, 2) == pytest.approx(0.1)
    assert free_cores(before, before, 2) is None


def test_an_engine_is_built_on_one_thread_and_steps_on_its_own_count(tiny_llama_dir, monkeypatch):
    """libgomp keeps a thread pool for every thread that ran a parallel region, and past
    one pool per core its barriers sleep in the kernel (engine.threads.single_threaded):
    the building thread, often not the stepping one, runs its load on one thread, gets its
    own count back, and the stepping thread runs the configured count."""
    counts_while_loading = []
    load = LlamaForward.__init__

    def counting_load(self, *args, **kwargs):
        counts_while_loading.append(torch.get_num_threads())
        load(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForward, "__init__", counting_load)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = make_engine(tiny_llama_dir, num_threads=3)
        assert counts_while_loading == [1]
        assert torch.get_num_threads() == 2
        counts_in_step = []
        step = engine.model.forward
        monkeypatch.setattr(
            engine.model,
            "forward",
            lambda *a, **k: counts_in_step.append(torch.get_num_threads()) or step(*a, **k),
        )
        engine.generate([prompt_of(5, salt=9)], GREEDY)
        assert counts_in_step and set(counts_in_step) == {3}
    finally:
        torch.set_num_threads(before)
