"""FlashAttention-2 behind `AttentionBackend`, on CUDA when `flash_attn` is importable.

Picked by `make_attention_backend('flash_attn')` (alias `flash`) on a CUDA device with
fp16/bf16, and by `auto` where FA2 can read the paged pool (blocks of a multiple of
256 tokens); never imported on CPU. A step whose prefill chunks are all fresh prompts
runs them in one `flash_attn_varlen_func` call on their own keys and values. Decode
rows read the pool in place through `flash_attn_with_kvcache(block_table=...)` where
the block size allows it. Everything else (decode at smaller blocks, chunks after
cached context, sliding windows) runs on the Triton kernels of the base class, never
on a dense gather.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from engine.triton_backend import TritonPagedAttention

PAGED_BLOCK_MULTIPLE = 256


@functools.cache
def flash_available(dtype: torch.dtype) -> bool:
    return (
        dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.is_available()
        and importlib.util.find_spec("flash_attn") is not None
    )


class FlashPagedAttention(TritonPagedAttention):
    """CUDA backend: FA2 where it can serve a call, the Triton kernels elsewhere."""

    name = "flash_attn"

    def __init__(self):
        import flash_attn

        self.flash = flash_attn

    @staticmethod
    def pages(block_size: int) -> bool:
        """Whether FA2 reads a pool of `block_size`-token blocks in place."""
        return block_size % PAGED_BLOCK_MULTIPLE == 0

    def _decode(self, q, kv_pool, layer: int, meta, scale, out, window) -> None:
        if window is not None or not self.pages(kv_pool.block_size):
            return super()._decode(q, kv_pool, layer, meta, scale, out, window)
        attended = self.flash.flash_attn_with_kvcache(
            q.unsqueeze(1),
            kv_pool.layer_view(layer, 0),
            kv_pool.layer_view(layer, 1),
            cache_seqlens=meta.decode_context_lens.to(torch.int32),
            block_table=meta.decode_block_tables.to(torch.int32),
            softmax_scale=scale,
            causal=True,
        )
        out.copy_(attended.flatten(1))

    def _prefill(self, q, k, v, kv_pool, layer: int, meta, scale, out, window) -> None:
        chunks = meta.prefill_chunks
        if window is not None or any(c.context_start for c in chunks):
            return super()._prefill(q, k, v, kv_pool, layer, meta, scale, out, window)
        batch = meta.prefill_batch
        rows = slice(chunks[0].query_start, chunks[-1].query_start + chunks[-1].query_len)
        starts = (batch.query_starts - chunks[0].query_start).to(torch.int32)
        attended = self.flash.flash_attn_varlen_func(
            q[rows],
            k[rows],
            v[rows],
            cu_seqlens_q=starts,
            cu_seqlens_k=starts,
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=batch.max_query_len,
            softmax_scale=scale,
            causal=True,
        )
        out[rows] = attended.flatten(1)
