"""Paged attention on the native float32 CPU kernels.

Decode rows read their blocks where they lie in the pool (`pd_decode_attention`), so a
decode step no longer copies every block of every sequence into a dense tensor per
layer (10-16% of a batch-16 step with the gather). Prefill chunks keep torch's CPU
flash SDPA; a chunk after cached context gathers it with `pd_gather_kv`.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from engine.native.ops import NativeKernels


class NativePagedAttention(TorchPagedAttention):
    """Float32 CPU backend; `kernels` are the process's `NativeKernels`."""

    name = "native"

    def __init__(self, kernels: NativeKernels):
        self.kernels = kernels

    def _decode(self, q, kv_pool, layer: int, meta: AttentionMetadata, scale, out) -> None:
        num_rows, num_heads, head_dim = q.shape
        keys, values = kv_pool.layer_view(layer, 0), kv_pool.layer_view(layer, 1)
        tables = meta.decode_block_tables
        status = self.kernels.decode_attention(
            q.data_ptr(),
            q.stride(0),
            num_rows,
            num_heads,
            keys.shape[2],
            head_dim,
            keys.data_ptr(),
            values.data_ptr(),
            keys.stride(0),
            keys.shape[1],
            tables.data_ptr(),
            tables.stride(0),
            meta.decode_context_lens.data_ptr(),
            scale,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if status != 0:
            super()._decode(q, kv_pool, layer, meta, scale, out)

    def _context(self, kv_pool, layer: int, chunk: PrefillChunk):
        keys, values = kv_pool.layer_view(layer, 0), kv_pool.layer_view(layer, 1)
        num_kv_heads, head_dim = keys.shape[2], keys.shape[3]
        context_len = chunk.context_start + chunk.query_len
        shape = (1, num_kv_heads, context_len, head_dim)
        key_out, value_out = torch.empty(shape), torch.empty(shape)
        self.kernels.gather_kv(
            keys.data_ptr(),
            values.data_ptr(),
            keys.stride(0),
            keys.shape[1],
            num_kv_heads,
            head_dim,
            chunk.block_table.data_ptr(),
            context_len,
            key_out.data_ptr(),
            value_out.data_ptr(),
            torch.get_num_threads(),
        )
        return key_out, value_out
