"""FlashAttention-2 behind `AttentionBackend`, on CUDA when `flash_attn` is importable.

Picked by `make_attention_backend('auto' | 'flash')` on a CUDA device with fp16/bf16;
never imported on CPU. Fresh prompts run `flash_attn_func` (causal, GQA native) on
their own keys and values. Decode rows read the paged pool in place through
`flash_attn_with_kvcache(block_table=...)`, which FlashAttention-2 allows only for
blocks of a multiple of 256 tokens: with smaller blocks (the default is 16) decode
and chunks after cached context keep the torch gather path of the base class.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from engine.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention

PAGED_BLOCK_MULTIPLE = 256


@functools.cache
def flash_available(dtype: torch.dtype) -> bool:
    return (
        dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.is_available()
        and importlib.util.find_spec("flash_attn") is not None
    )


class FlashPagedAttention(TorchPagedAttention):
    """CUDA backend; falls back to the torch path per call where FA2 cannot serve it."""

    name = "flash"

    def __init__(self):
        import flash_attn

        self.flash = flash_attn

    def _decode(self, q, kv_pool, layer: int, meta: AttentionMetadata, scale, out) -> None:
        if kv_pool.block_size % PAGED_BLOCK_MULTIPLE:
            return super()._decode(q, kv_pool, layer, meta, scale, out)
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

    def _prefill(self, q, k, v, kv_pool, layer: int, chunk: PrefillChunk, scale):
        if chunk.context_start:
            return super()._prefill(q, k, v, kv_pool, layer, chunk, scale)
        attended = self.flash.flash_attn_func(
            q[None], k[None], v[None], softmax_scale=scale, causal=True
        )
        return attended[0]
