"""Paged attention in Triton: decode rows and prefill chunks read the KV pool in place.

Once per layer of a step, `TritonPagedAttention.forward` (engine/triton_backend.py)
calls `decode_attention` for the step's decode rows and `prefill_attention` for its
prefill chunks, after the step's new keys and values are in the pool. Neither copies
a block: each reads the layer's keys and values where they lie, through the pool's
strides (block-major: `kv[block, layer, 2, slot, kv_head, dim]`, engine/kv_cache.py).

One kernel serves both (the design of vLLM's `triton_unified_attention`). A program
owns one sequence, one KV head and one block of the sequence's query positions:

- its rows are (query position, query head of the KV head's group) pairs, so all the
  heads that share a KV head share every key and value tile it loads (GQA without
  repeating KV); a decode program has one position, a prefill one BLOCK_Q of them;
- it walks the keys in tiles of TILE_N positions; each key's block comes from the
  sequence's block table (`position // block_size`), so a tile may span blocks and
  any block size (16 and up) works;
- it keeps an online softmax in float32 (running max and sum, exp2), one pass;
- keys after a query's own position are masked (causal within a chunk, whatever the
  cached context before it), and with a sliding window those `window` or more
  positions before it; tiles wholly outside both are never loaded.

Head dims that are not powers of two (16 at least: `tl.dot`'s minimum) are padded
with masked loads. Decode with too few programs to fill the GPU splits each row's keys
over NUM_SPLITS programs (flash-decoding); `_merge_kernel` then combines their partial
softmaxes. Grids and split counts depend only on tensor shapes, never on their
contents, so a decode launch replays inside a CUDA graph.

Deterministic mode (`deterministic=True`, the engine's `deterministic` setting): the
split count follows the batch (how many programs fill the GPU), and a split row sums
its keys in another order, so decode never splits; and prefill programs take decode's
row block (BLOCK_M of `DECODE_ROWS`, its heads padded), so that every query row, decode
or prefill, is scored and weighted by dots of one shape over the same key tiles in the
same order. Key tiles past a row's own position, or before its window, leave its online
softmax exactly as it was (weights 0, rescale 1), so neither the chunking of a prompt
nor the rows beside it change a row's bits. Long decode rows at small batch then run
on fewer programs, and prefill on smaller tiles: slower, for the same bits.

`reference_attention` beside the kernels is the dense computation they must equal.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine import envs
from engine.attention import SeqBatch

LOG2E = 1.4426950408889634
PREFILL_ROWS = 64
"""Rows (query positions x heads of a group) of one prefill program."""
DECODE_ROWS = 16
"""Rows of one decode program: the group's heads, padded to `tl.dot`'s minimum."""
KEY_TILE = 32
"""Key positions per tile."""
MAX_SPLITS = 16
"""Most programs one decode row's keys are split over."""


def _next_power_of_2(value: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(value))


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, ROW_EXACT: tl.constexpr = False):
    """a @ b accumulated in float32: on float32 inputs in IEEE float32 (TF32 would round
    them to 10 bits), and under the interpreter always in float32 (its bf16 dot is
    wrong); on the GPU's fp16/bf16 inputs, on the tensor cores. `ROW_EXACT` (the
    interpreter in deterministic mode): products summed over k in order, element by
    element. The interpreter's dot is numpy's BLAS, which sums a row by other paths at
    other places in the tile; a tensor core's dot does not depend on the place.
    """
    if ROW_EXACT:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attention_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    k_ptr,
    v_ptr,
    kv_stride_b,
    kv_stride_s,
    kv_stride_h,
    out_ptr,
    out_stride_t,
    out_stride_h,
    tables_ptr,
    table_stride,
    seq_lens_ptr,
    query_starts_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    window,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DECODE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROW_EXACT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    if DECODE:
        first_row = seq
        query_len = 1
    else:
        first_row = tl.load(query_starts_ptr + seq)
        query_len = tl.load(query_starts_ptr + seq + 1) - first_row
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_pos < query_len)
    dim_ok = offs_d < HEAD_DIM
    rows = (first_row + q_pos).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_abs = context + q_pos

    # Keys this block of queries can see: up to its last query's position, and with a
    # window from its first query's window start.
    key_end = context + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, query_len)
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(context + q_block * BLOCK_Q - window + 1, 0)
    tile_lo = key_start // TILE_N
    tile_hi = tl.cdiv(key_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * table_stride
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = offs_n < key_end
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_offset = block * kv_stride_b + (offs_n % BLOCK_SIZE) * kv_stride_s
        kv_offset += kv_head * kv_stride_h
        keys = tl.load(
            k_ptr + kv_offset[None, :] + offs_d[:, None],
            mask=dim_ok[:, None] & key_ok[None, :],
            other=0.0,
        )
        values = tl.load(
            v_ptr + kv_offset[:, None] + offs_d[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        scores = _dot(q, keys.to(q.dtype), DOT_F32, ROW_EXACT) * scale_log2
        visible = row_ok[:, None] & key_ok[None, :] & (offs_n[None, :] <= q_abs[:, None])
        if USE_WINDOW:
            visible = visible & (q_abs[:, None] - offs_n[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps max -inf: shift by 0, not -inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = values.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, DOT_F32, ROW_EXACT)
        m_i = m_new

    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offset = rows[:, None] * out_stride_t + head[:, None] * out_stride_h + offs_d[None, :]
        tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = (rows * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=store_mask)


@triton.jit
def _merge_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    out_stride_t,
    out_stride_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One (row, head): the softmax over all keys from its splits' partial ones."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    split_ok = offs_s < NUM_SPLITS
    part = (row * NUM_HEADS + head) * NUM_SPLITS + offs_s
    maxes = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    accs = tl.load(
        part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )
    top = tl.max(maxes, axis=0)
    # Splits that saw no key hold max -inf and sum 0: weight 0.
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - top))
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(weights[:, None] * accs, axis=0) / total
    tl.store(
        out_ptr + row * out_stride_t + head * out_stride_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def decode_splits(
    num_rows: int,
    num_kv_heads: int,
    max_keys: int,
    device: torch.device,
    deterministic: bool = False,
) -> int:
    """How many programs share each decode row's keys: enough that the launch fills the
    GPU twice over, at most one key tile each and `MAX_SPLITS`; 1 on a CPU, and in
    deterministic mode (the count follows the batch). Depends on shapes only (the same
    for every replay of a captured graph)."""
    if device.type != "cuda" or deterministic:
        return 1
    programs = num_rows * num_kv_heads
    multiprocessors = _multiprocessors(device.index)
    if programs >= multiprocessors:
        return 1
    wanted = triton.cdiv(2 * multiprocessors, programs)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_keys, KEY_TILE)))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _no_partials(device: torch.device) -> torch.Tensor:
    """What the kernel's partial-softmax pointers get when nothing is split (never read)."""
    return torch.empty(1, dtype=torch.float32, device=device)


def _dot_f32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or envs.triton_interpret()


def _launch(
    q,
    k_cache,
    v_cache,
    out,
    batch: SeqBatch,
    scale,
    window,
    grid,
    block_m,
    decode,
    splits,
    deterministic=False,
):
    """Launch the kernel; `out` [rows, Hq * D] or [rows, Hq, D] (heads contiguous)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out3 = out.view(out.shape[0], num_heads, head_dim)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("keys and values need the same strides, head dims contiguous")
    head_pad = _next_power_of_2(head_dim)
    parts = _partials(out.shape[0], num_heads, splits, head_pad, q.device)
    _attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out3, out3.stride(0), out3.stride(1),
        batch.block_tables, batch.block_tables.stride(0), batch.seq_lens, batch.query_starts,
        *parts,
        scale * LOG2E, window or 0,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=1 if decode else block_m // group,
        TILE_N=KEY_TILE, DECODE=decode, NUM_SPLITS=splits, USE_WINDOW=window is not None,
        DOT_F32=_dot_f32(q.dtype), ROW_EXACT=deterministic and envs.triton_interpret(),
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(out.shape[0], num_heads)](
            *parts, out3, out3.stride(0), out3.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )  # fmt: skip


def _partials(rows: int, num_heads: int, splits: int, head_pad: int, device) -> tuple:
    """Scratch for the splits' partial softmaxes (unused, but still passed, at 1 split)."""
    if splits == 1:
        unused = _no_partials(device)
        return unused, unused, unused
    shape = (rows, num_heads, splits)
    return (
        torch.empty(*shape, head_pad, dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    num_splits: int | None = None,
    deterministic: bool = False,
) -> None:
    """One query row per sequence (its newest token, already in the pool) over its
    context; writes `out` [rows, Hq * D]. q [rows, Hq, D]; k_cache, v_cache [blocks,
    block_size, Hkv, D] (a layer's strided view of the pool); block_tables [rows,
    width]; context_lens [rows] (tokens in the pool, the new one included).
    `num_splits` None picks `decode_splits`; `deterministic` never splits (see the
    module's docstring). No host synchronisation: graph-safe."""
    rows, num_heads = q.shape[0], q.shape[1]
    num_kv_heads = k_cache.shape[2]
    max_keys = block_tables.shape[1] * k_cache.shape[1]
    splits = 1 if deterministic else num_splits
    splits = splits or decode_splits(rows, num_kv_heads, max_keys, q.device)
    # a decode program finds its row by its index: query_starts is never read
    batch = SeqBatch(context_lens, context_lens, block_tables, 1)
    block_m = _next_power_of_2(num_heads // num_kv_heads, DECODE_ROWS)
    grid = (rows, num_kv_heads, splits)
    _launch(
        q, k_cache, v_cache, out, batch, scale, window, grid, block_m, True, splits, deterministic
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: SeqBatch,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    deterministic: bool = False,
) -> None:
    """Prefill chunks, each after its sequence's cached context (0 for a fresh prompt),
    in one launch: chunk s's rows of q attend causally to its keys in the pool; writes
    the same rows of `out` [T, Hq * D]. Rows of q outside every chunk are left alone.
    `deterministic`: programs of decode's row block (see the module's docstring)."""
    if batch.num_seqs == 0:
        return
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m = _next_power_of_2(group, DECODE_ROWS if deterministic else PREFILL_ROWS)
    grid = (batch.num_seqs, num_kv_heads, triton.cdiv(batch.max_query_len, block_m // group))
    _launch(q, k_cache, v_cache, out, batch, scale, window, grid, block_m, False, 1, deterministic)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: SeqBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The dense computation the kernels must equal, in float32: each sequence's blocks
    gathered, softmax(q k^T * scale) v with causal (and window) masks. [T, Hq, D]; rows
    outside every sequence are zero."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = batch.query_starts.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        rows = slice(starts[seq], starts[seq + 1])
        query_len = starts[seq + 1] - starts[seq]
        positions = torch.arange(seq_len, device=q.device)
        blocks = batch.block_tables[seq, positions // block_size]
        keys, values = (
            cache[blocks, positions % block_size]
            .float()
            .repeat_interleave(num_heads // num_kv_heads, dim=1)
            for cache in (k_cache, v_cache)
        )
        query_pos = positions[seq_len - query_len :]
        visible = positions[None, :] <= query_pos[:, None]
        if window is not None:
            visible &= query_pos[:, None] - positions[None, :] < window
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * scale
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", weights, values)
    return out
