"""The KV store in Triton: a step's new keys and values into their pool slots.

Once per layer of a step, after rotary embedding, `TorchOps.rope_store` hands the new
tokens' keys and values [T, Hkv, D] to the attention backend's store
(`TritonPagedAttention.kv_store`), which calls `store_kv`: token t goes to slot
`slot_offsets[t]` of block `slot_blocks[t]` of the layer's keys and values. In the
block-major pool (engine/kv_cache.py) one token's heads of one layer are one
contiguous run, so a program stores one token: its [Hkv, D] keys and values, padded
to powers of two with masks. The grid is the token count (no host synchronisation:
graph-safe). `KVCachePool.write_slots` is the reference it must equal bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(
    k_ptr,
    v_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    pool_k_ptr,
    pool_v_ptr,
    pool_stride_b,
    pool_stride_s,
    pool_stride_h,
    blocks_ptr,
    offsets_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    block = tl.load(blocks_ptr + token).to(tl.int64)
    slot = tl.load(offsets_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    target = block * pool_stride_b + slot * pool_stride_s + heads * pool_stride_h + dims
    keys = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + dims, mask=mask)
    values = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims, mask=mask)
    tl.store(pool_k_ptr + target, keys, mask=mask)
    tl.store(pool_v_ptr + target, values, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] (head dims contiguous) into k_cache, v_cache [blocks,
    block_size, Hkv, D] (a layer's strided views of the pool) at (block, offset) slots,
    in the pool's dtype."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("store_kv needs contiguous head dims")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv needs keys and values laid out alike in the pool")
    # Converted here, not in the kernel: the interpreter's float32 -> bfloat16 truncates
    # where torch and the GPU round to nearest (no copy on the engine's path, where the
    # activations and the pool share a dtype).
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    _store_kernel[(num_tokens,)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slot_blocks, slot_offsets,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
