"""The Triton attention and KV-store kernels against their dense references, and the
engine's whole GPU path (`attention_backend: triton`) against transformers.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here
before triton is first imported): the CPU debug mode of the GPU path. With CUDA they
run compiled, on the GPU, and the same comparisons hold.

Error bounds, against the reference computed in float32 from the same (rounded) inputs:
float32 1e-5 (absolute and relative; the kernels' dots are IEEE float32, never TF32),
float16 2e-3, bfloat16 1.6e-2: outputs are rounded to the dtype (bf16 keeps 8 bits of
mantissa, 2^-8 relative), and the softmax weights are rounded to it before the
weighted sum of values, as the tensor cores take them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Before anything imports triton: the interpreter is chosen when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.attention import (
    AttentionMetadata,
    PrefillChunk,
    SeqBatch,
    TorchPagedAttention,
)
from engine.config import EngineConfig
from engine.kv_cache import KVCachePool, KVLayout
from engine.llm_engine import LLMEngine
from engine.native.attention import NativePagedAttention
from engine.native.ops import native_kernels
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.triton_backend import TritonPagedAttention, triton_runs_on
from tests.factories import hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def prompt_of(length: int, salt: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(1000 + 17 * length + salt)
    return torch.randint(2, 300, (length,), generator=generator).tolist()


pytestmark = pytest.mark.skipif(
    triton_runs_on(DEVICE) is not None, reason=str(triton_runs_on(DEVICE))
)
ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DECODE_LENS = [1, 16, 37, 32, 5, 64]
"""Ragged, with a lone token and exact multiples of both block sizes."""
CHUNKS = [(0, 1), (0, 16), (16, 7), (5, 32), (37, 1), (0, 45), (32, 32)]
"""(cached context, query rows) of each prefill chunk: fresh prompts, chunks after a
context that ends inside a block and at a block's edge, lone rows."""


def kernels():
    from engine.kernels import triton_attention, triton_kv_store

    return triton_attention, triton_kv_store


def paged_case(lengths, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    """Layer 1's keys and values of a random 2-layer block-major pool, and block tables
    over shuffled blocks for sequences of `lengths` tokens."""
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 3
    pool = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=generator)
    pool = pool.to(device=DEVICE, dtype=dtype)
    order = torch.randperm(num_blocks, generator=generator)[: len(lengths) * width]
    tables = order.view(len(lengths), width).to(DEVICE)
    num_rows = len(lengths)
    q = torch.randn(num_rows, num_kv_heads * group, head_dim, generator=generator)
    return q.to(device=DEVICE, dtype=dtype), pool[:, 1, 0], pool[:, 1, 1], tables


def seq_batch(contexts_and_rows, tables) -> SeqBatch:
    starts, row = [], 0
    for _, rows in contexts_and_rows:
        starts.append(row)
        row += rows
    return SeqBatch(
        query_starts=torch.tensor([*starts, row], device=DEVICE),
        seq_lens=torch.tensor([c + r for c, r in contexts_and_rows], device=DEVICE),
        block_tables=tables,
        max_query_len=max(r for _, r in contexts_and_rows),
    )


def assert_matches(out, expected, dtype, msg=""):
    bound = TOLERANCE[dtype]
    out = out.float().view(expected.shape)
    torch.testing.assert_close(out, expected, atol=bound, rtol=bound, msg=msg)


def run_decode(lengths, block_size, group, head_dim, dtype, window=None, splits=None, kv=2):
    attention, _ = kernels()
    q, keys, values, tables = paged_case(lengths, block_size, kv, group, head_dim, dtype)
    lens = torch.tensor(lengths, device=DEVICE)
    out = torch.empty(len(lengths), q.shape[1] * head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    attention.decode_attention(q, keys, values, tables, lens, scale, out, window, splits)
    batch = seq_batch([(n - 1, 1) for n in lengths], tables)
    expected = attention.reference_attention(q, keys, values, batch, scale, window)
    assert_matches(out, expected, dtype)


def run_prefill(chunks, block_size, group, head_dim, dtype, window=None, kv=2):
    attention, _ = kernels()
    lengths = [c + r for c, r in chunks]
    _, keys, values, tables = paged_case(lengths, block_size, kv, group, head_dim, dtype)
    batch = seq_batch(chunks, tables)
    rows = int(batch.query_starts[-1])
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(rows, kv * group, head_dim, generator=generator).to(DEVICE, dtype)
    out = torch.empty(rows, kv * group * head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    attention.prefill_attention(q, keys, values, batch, scale, out, window)
    expected = attention.reference_attention(q, keys, values, batch, scale, window)
    assert_matches(out, expected, dtype)


SHAPES = pytest.mark.parametrize(
    ("block_size", "group", "head_dim"),
    # every block size with every GQA ratio, and with both head dims (not every triple:
    # the interpreter takes a second or two per case)
    [(16, 1, 64), (16, 4, 128), (16, 8, 64), (32, 1, 128), (32, 4, 64), (32, 8, 128)],
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)


@SHAPES
@DTYPES
def test_decode_kernel_equals_the_dense_reference(block_size, group, head_dim, dtype):
    run_decode(DECODE_LENS, block_size, group, head_dim, dtype)


@SHAPES
@DTYPES
def test_prefill_kernel_attends_causally_over_cached_context(block_size, group, head_dim, dtype):
    run_prefill(CHUNKS, block_size, group, head_dim, dtype)


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 20), (1, 5, 16), (2, 1, 24)]
)
def test_head_dims_and_groups_that_are_not_powers_of_two(num_kv_heads, group, head_dim):
    """The tiny test models' shapes (9 query heads over 3 KV heads, head dim 16 or 20):
    head dims padded inside the kernel, group rows packed, both masked."""
    run_decode(DECODE_LENS, 16, group, head_dim, torch.float32, kv=num_kv_heads)
    run_prefill(CHUNKS, 16, group, head_dim, torch.float32, kv=num_kv_heads)


def test_float16_stays_within_its_bound():
    run_decode(DECODE_LENS, 16, 4, 64, torch.float16)
    run_prefill(CHUNKS, 16, 4, 64, torch.float16)


@pytest.mark.parametrize("splits", [3, 8])
@DTYPES
def test_decode_split_over_programs_merges_to_the_same_softmax(splits, dtype):
    """Flash-decoding: each row's keys split over programs, some of them left with no
    key at all (short rows), their partial softmaxes merged."""
    run_decode([1, 5, 70, 129, 33], 16, 4, 64, dtype, splits=splits)


@pytest.mark.parametrize("window", [1, 16, 40])
def test_sliding_window_hides_keys_before_it(window):
    """A query at position p sees keys in (p - window, p]: windows shorter than a block,
    one block, several; with splits, some of them wholly outside the window."""
    run_decode(DECODE_LENS, 16, 4, 64, torch.float32, window=window)
    run_decode([70, 129], 16, 4, 64, torch.float32, window=window, splits=4)
    run_prefill(CHUNKS, 16, 4, 64, torch.float32, window=window)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_store_kernel_writes_what_write_slots_writes(pool_dtype):
    """Bit for bit, into shuffled slots of a strided layer, from a strided source (keys
    and values as views of a fused qkv row), converting to the pool's dtype."""
    _, kv_store = kernels()
    layout = KVLayout("tiny", str(pool_dtype).removeprefix("torch."), 2, 3, 20, 16)
    pools = [KVCachePool(layout, 8, DEVICE) for _ in range(2)]
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(21, 9 * 20 + 2 * 3 * 20, generator=generator).to(DEVICE)
    k = qkv[:, 180:240].view(21, 3, 20)
    v = qkv[:, 240:].view(21, 3, 20)
    slots = torch.randperm(8 * 16, generator=generator)[:21].to(DEVICE)
    blocks, offsets = slots // 16, slots % 16

    pools[0].write_slots(1, blocks, offsets, k, v)
    kv_store.store_kv(k, v, pools[1].layer_view(1, 0), pools[1].layer_view(1, 1), blocks, offsets)

    assert torch.equal(pools[0].kv, pools[1].kv)
    assert pools[1].kv[:, 0].abs().sum() == 0  # layer 0 untouched


def mixed_step(pool: KVCachePool, layer: int, lengths, chunks, seed=2):
    """A packed step over `pool` (block size 16): one decode row per entry of `lengths`,
    then prefill chunks (context, rows); every token of every sequence already in the
    pool. Returns q, k, v of the step's rows and its metadata."""
    generator = torch.Generator().manual_seed(seed)
    spec = pool.layout
    free = iter(torch.randperm(pool.num_blocks, generator=generator).tolist())
    tables = []
    for total in [*lengths, *(c + r for c, r in chunks)]:
        table = torch.tensor([next(free) for _ in range(-(-total // 16))], device=DEVICE)
        tables.append(table)
        positions = torch.arange(total, device=DEVICE)
        kv = torch.randn(2, total, spec.num_kv_heads, spec.head_dim, generator=generator)
        pool.write_slots(layer, table[positions // 16], positions % 16, *kv.to(DEVICE))
    width = max(t.shape[0] for t in tables[: len(lengths)])
    decode_tables = torch.zeros(len(lengths), width, dtype=torch.long, device=DEVICE)
    for row, table in enumerate(tables[: len(lengths)]):
        decode_tables[row, : table.shape[0]] = table
    prefill, row = [], len(lengths)
    for (context, rows), table in zip(chunks, tables[len(lengths) :], strict=True):
        prefill.append(PrefillChunk(row, rows, context, table))
        row += rows
    meta = AttentionMetadata(
        slot_blocks=torch.zeros(row, dtype=torch.long, device=DEVICE),
        slot_offsets=torch.zeros(row, dtype=torch.long, device=DEVICE),
        num_decode_tokens=len(lengths),
        decode_block_tables=decode_tables,
        decode_context_lens=torch.tensor(lengths, device=DEVICE),
        prefill_chunks=prefill,
    )
    q = torch.randn(row, 9, spec.head_dim, generator=generator).to(DEVICE)
    k, v = (torch.randn(row, spec.num_kv_heads, spec.head_dim, generator=generator) for _ in "kv")
    # a chunk's own keys and values, as rope_store leaves them: what the pool holds
    for chunk in prefill:
        positions = torch.arange(chunk.context_start, chunk.context_start + chunk.query_len)
        table = chunk.block_table.cpu()
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        k[rows] = pool.layer_view(layer, 0)[table[positions // 16], positions % 16].cpu()
        v[rows] = pool.layer_view(layer, 1)[table[positions // 16], positions % 16].cpu()
    return q, k.to(DEVICE), v.to(DEVICE), meta


@pytest.mark.parametrize("window", [None, 6, 20])
def test_backend_equals_the_torch_gather_path_on_a_mixed_step(window):
    """Decode rows and prefill chunks of one packed step, through `forward` as the model
    calls it: the Triton backend's output is the torch reference backend's (which honors
    the window too), and so is the native CPU backend's where it exists (its kernels
    know no window: a window that cuts a row's context takes the torch path)."""
    layout = KVLayout("tiny", "float32", 2, 3, 20, 16)
    pool = KVCachePool(layout, 40, DEVICE)
    q, k, v, meta = mixed_step(pool, 1, [1, 16, 37, 50], [(0, 9), (16, 5), (21, 16)])
    scale = 20**-0.5

    expected = TorchPagedAttention().forward(q, k, v, pool, 1, meta, scale, window=window)
    out = TritonPagedAttention().forward(q, k, v, pool, 1, meta, scale, window=window)

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if DEVICE == "cpu" and native_kernels() is not None:
        native = NativePagedAttention(native_kernels())
        out = native.forward(q, k, v, pool, 1, meta, scale, window=window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if window is not None:
        unwindowed = TorchPagedAttention().forward(q, k, v, pool, 1, meta, scale)
        assert not torch.allclose(unwindowed, expected)  # the window hid something


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def triton_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(
        model=str(model_dir), dtype="float32", device=DEVICE, attention_backend="triton",
        block_size=16, prefill_chunk_size=16, max_batch_tokens=64, num_kv_blocks=256,
        num_threads=1,
    )  # fmt: skip
    return LLMEngine(EngineConfig(**settings | overrides))


def assert_no_leaks(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    engine.allocator.assert_all_free()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_on_the_triton_path_decodes_as_transformers(tiny_model_dirs, family):
    """The whole GPU path in the real engine (torch layer ops, the Triton KV store and
    attention): batched prompts of 5, 16 and 37 tokens (the last over three chunks of
    16, each attending to the cached context), then a prompt whose first 32 tokens are a
    prefix-cache hit; greedy tokens equal transformers'."""
    model_dir = tiny_model_dirs[family]
    engine = triton_engine(model_dir)
    assert (engine.model.attention.name, engine.model.ops.name) == ("triton", "torch")
    prompts = [prompt_of(n, salt=4) for n in (5, 16, 37)]

    outputs = engine.generate(prompts, GREEDY)
    hit_prompt = prompts[2][:32] + prompt_of(6, salt=9)
    (hit,) = engine.generate([hit_prompt], GREEDY)

    for prompt, seq in zip([*prompts, hit_prompt], [*outputs, hit], strict=True):
        assert seq.output_token_ids == hf_greedy(model_dir, prompt, 6)[0]
    assert hit.num_cached_tokens == 32
    assert_no_leaks(engine)


def test_decode_graph_warmups_on_the_triton_path_write_only_the_scratch_block(tiny_llama_dir):
    """The in-place backend needs one table width per batch bucket; run eagerly, the
    warm-ups write only the scratch block and a padded step's logits are the step's."""
    from engine.cuda_graphs import DecodeGraphs

    engine = triton_engine(tiny_llama_dir)
    for i, length in enumerate((5, 33)):
        engine.add_request(f"seq-{i}", prompt_of(length, salt=1), GREEDY)
    while any(not s.output_token_ids for s in engine.sequences.values()):
        engine.step()
    chunks = engine.scheduler.schedule()
    step = engine.runner.build_step(chunks)
    (scratch,) = engine.allocator.allocate(1, "scratch")
    graphs = DecodeGraphs(engine.model, engine.kv_pool, scratch, capture=False)
    before = engine.kv_pool.kv.clone()

    graphs.capture_all(max_num_seqs=2)

    assert graphs.widths == (512 // 16,) and set(graphs.steps) == {(1, 32), (2, 32)}
    changed = (before != engine.kv_pool.kv).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert changed == [scratch]
    expected = engine.model.forward(
        step.input_ids, step.positions, step.meta, engine.kv_pool, step.logits_rows
    )
    torch.testing.assert_close(graphs.run(step), expected, atol=1e-5, rtol=1e-5)
    engine.allocator.free([scratch])
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)
    assert_no_leaks(engine)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's command path, on a CPU")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pdserve_generate_runs_the_triton_kernels_under_the_interpreter(tiny_model_dirs, family):
    """`pdserve generate --attention-backend triton` on a CPU, in a fresh process under
    TRITON_INTERPRET=1: a prompt of three 16-token chunks (the later ones over cached
    context); the text is transformers' greedy continuation, decoded."""
    model_dir = tiny_model_dirs[family]
    text = "Zebras juggle 42 purple umbrellas near Köln."  # 38 tokens
    tokenizer = Tokenizer(model_dir)
    prompt = tokenizer.encode(text)
    assert 32 < len(prompt) <= 48
    expected = hf_greedy(model_dir, prompt, 8)[0]
    stops = [i for i, token in enumerate(expected) if token in tokenizer.eos_token_ids]
    expected = expected[: stops[0]] if stops else expected
    assert len(expected) >= 4  # a continuation worth comparing
    command = [
        sys.executable, "-m", "cluster.cli", "generate", "--model", str(model_dir),
        "--attention-backend", "triton", "--block-size", "16", "--prefill-chunk-size", "16",
        "--prompt", text, "--max-tokens", "8",
    ]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == tokenizer.decode(expected) + "\n"


def test_kernels_compile_for_a_hopper_gpu():
    """What the interpreter never does: lower the kernels through Triton's GPU passes and
    ptxas to sm_90 code (tests/triton_compile_check.py, in a process of its own), so a
    kernel that would not build on a GPU fails here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    command = [sys.executable, "-m", "tests.triton_compile_check"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.endswith("ok\n")
