"""Paged attention on the native float32 CPU kernels, over a float32 or bfloat16 pool.

Decode rows read their blocks where they lie in the pool (`pd_decode_attention`), so a
decode step no longer copies every block of every sequence into a dense tensor per
layer (10-16% of a batch-16 step with the gather). A prefill chunk, fresh or after
cached context, runs as register-tiled matmuls over its sequence's blocks
(`pd_prefill_attention`); torch's CPU flash SDPA (the chunk's own keys, or the context
gathered with `pd_gather_kv`) takes the head dims that kernel does not.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from engine.native.ops import NativeKernels


class NativePagedAttention(TorchPagedAttention):
    """Float32 CPU backend (the pool float32 or bfloat16); `kernels` are the process's
    `NativeKernels`. `deterministic`: decode rows in a prefill row's arithmetic
    (prefill_attention.c's `decode_row_exact`), so a token's attention has the same bits
    in any batch and whether it was decoded or prefilled in any chunk; shapes the kernels
    decline then raise instead of falling back to torch, whose bits differ."""

    name = "native"

    def __init__(self, kernels: NativeKernels, deterministic: bool = False):
        self.kernels = kernels
        self.deterministic = deterministic

    def _declined(self, what: str, head_dim: int) -> None:
        if self.deterministic:
            raise RuntimeError(
                f"the native {what} attention kernel declined this step (head dim {head_dim}); "
                "deterministic mode has no other path with the same bits"
            )

    def _decode(self, q, kv_pool, layer: int, meta: AttentionMetadata, scale, out) -> None:
        tables = meta.decode_block_tables
        status = self.kernels.decode_attention(
            **_query_and_pool(q, kv_pool, layer, "R"),
            block_tables=tables.data_ptr(),
            table_stride=tables.stride(0),
            context_lens=meta.decode_context_lens.data_ptr(),
            scale=scale,
            out=out.data_ptr(),
            ldo=out.stride(0),
            nthreads=torch.get_num_threads(),
            kv_bf16=kv_pool.holds_bf16,
            deterministic=int(self.deterministic),
        )
        if status != 0:
            self._declined("decode", q.shape[2])
            super()._decode(q, kv_pool, layer, meta, scale, out)

    def _prefill(self, q, k, v, kv_pool, layer: int, chunk: PrefillChunk, scale):
        num_rows, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim or not chunk.block_table.is_contiguous():
            self._declined("prefill", head_dim)
            return super()._prefill(q, k, v, kv_pool, layer, chunk, scale)
        out = torch.empty(num_rows, num_heads, head_dim)
        status = self.kernels.prefill_attention(
            **_query_and_pool(q, kv_pool, layer, "T"),
            table=chunk.block_table.data_ptr(),
            context_start=chunk.context_start,
            scale=scale,
            out=out.data_ptr(),
            ldo=num_heads * head_dim,
            nthreads=torch.get_num_threads(),
            kv_bf16=kv_pool.holds_bf16,
        )
        if status != 0:
            self._declined("prefill", head_dim)
            return super()._prefill(q, k, v, kv_pool, layer, chunk, scale)
        return out

    def _context(self, kv_pool, layer: int, chunk: PrefillChunk):
        keys, values = kv_pool.layer_view(layer, 0), kv_pool.layer_view(layer, 1)
        num_kv_heads, head_dim = keys.shape[2], keys.shape[3]
        context_len = chunk.context_start + chunk.query_len
        shape = (1, num_kv_heads, context_len, head_dim)
        key_out, value_out = torch.empty(shape), torch.empty(shape)
        self.kernels.gather_kv(
            k_cache=keys.data_ptr(),
            v_cache=values.data_ptr(),
            block_stride=keys.stride(0),
            block_size=keys.shape[1],
            Hkv=num_kv_heads,
            D=head_dim,
            table=chunk.block_table.data_ptr(),
            n=context_len,
            k_out=key_out.data_ptr(),
            v_out=value_out.data_ptr(),
            nthreads=torch.get_num_threads(),
            kv_bf16=kv_pool.holds_bf16,
        )
        return key_out, value_out


def _query_and_pool(q: torch.Tensor, kv_pool, layer: int, rows: str) -> dict[str, int]:
    """The arguments both attention kernels start with: the query rows [rows, Hq, D]
    (heads contiguous within a row; `rows` names their count: R for decode, T for a
    prefill chunk) and the layer's keys and values in the pool."""
    num_rows, num_heads, head_dim = q.shape
    keys, values = kv_pool.layer_view(layer, 0), kv_pool.layer_view(layer, 1)
    return {
        "q": q.data_ptr(),
        "ldq": q.stride(0),
        rows: num_rows,
        "Hq": num_heads,
        "Hkv": keys.shape[2],
        "D": head_dim,
        "k_cache": keys.data_ptr(),
        "v_cache": values.data_ptr(),
        "block_stride": keys.stride(0),
        "block_size": keys.shape[1],
    }
