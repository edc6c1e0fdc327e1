"""Paged attention over the KV pool, and the seam where other kernels plug in.

One forward step packs the new tokens of many sequences into one row-major batch:
decode tokens first (one per sequence), then prefill chunks. Keys and values of the
new tokens are written into the pool before attention (`rope_store`), so a decode
row or a later prefill chunk reads earlier tokens from the same cache.

- A decode row attends to its sequence's blocks. `TorchPagedAttention` gathers them
  into a dense copy and runs SDPA (any device, any dtype); the native CPU backend
  (`engine.native.attention`) reads the blocks in place.
- A prefill chunk of a fresh prompt (nothing cached before it) attends to its own
  keys and values, which are already in hand: no gather. A chunk after cached context
  gathers that context once per layer.

`AttentionBackend` is the seam: a backend sees the same metadata and the pool, and is
picked by name (`make_attention_backend`), e.g. `flash` on CUDA when flash-attn is
importable (`engine.flash_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.config import ATTENTION_CHOICES
from engine.config import AttentionBackendName as AttentionChoice


@dataclass
class PrefillChunk:
    """One sequence's prefill piece inside a packed step."""

    query_start: int
    """Row of the chunk's first token in the packed batch."""
    query_len: int
    context_start: int
    """Tokens of this sequence already in the cache before this chunk."""
    block_table: torch.Tensor
    """Block ids covering positions [0, context_start + query_len)."""


@dataclass
class AttentionMetadata:
    """Where each new token's KV goes and what each query attends to."""

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    """[num_decode, max_blocks] padded with block 0 (masked out by context length)."""
    decode_context_lens: torch.Tensor | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)


class AttentionBackend:
    """Attention of one layer of one packed step; called by the model once per layer,
    after the step's new keys and values are in the pool."""

    name = "base"

    def forward(
        self,
        q,
        k,
        v,
        kv_pool,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ):
        """q [T, Hq, D]; k, v [T, Hkv, D] of the new tokens. Returns [T, Hq * D].
        `window`: None for full attention, else a query at position p sees keys at
        positions in (p - window, p]. `softcap`: scores become cap * tanh(score / cap)."""
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Reference backend on torch SDPA with GQA, any device and dtype."""

    name = "torch"

    def forward(self, q, k, v, kv_pool, layer: int, meta, scale: float, window=None, softcap=None):
        if window is not None or softcap is not None:
            from engine.masked_attention import masked_attention

            return masked_attention(q, k, v, kv_pool, layer, meta, scale, window, softcap)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        decode_count = meta.num_decode_tokens
        if decode_count:
            self._decode(q[:decode_count], kv_pool, layer, meta, scale, out[:decode_count])
        for chunk in meta.prefill_chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            attended = self._prefill(q[rows], k[rows], v[rows], kv_pool, layer, chunk, scale)
            out[rows] = attended.reshape(chunk.query_len, num_heads * head_dim)
        return out

    def _decode(self, q, kv_pool, layer: int, meta: AttentionMetadata, scale, out) -> None:
        # .to: a bf16 pool under float32 activations (the native kernels' fallback here)
        keys = _gather(kv_pool.layer_view(layer, 0), meta.decode_block_tables).to(q.dtype)
        values = _gather(kv_pool.layer_view(layer, 1), meta.decode_block_tables).to(q.dtype)
        positions = torch.arange(keys.shape[-2], device=q.device)
        mask = positions[None, :] < meta.decode_context_lens[:, None]
        attended = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out.copy_(attended.flatten(1))

    def _context(self, kv_pool, layer: int, chunk: PrefillChunk):
        """Keys and values of the chunk's sequence up to its last token: [1, Hkv, n, D]."""
        context_len = chunk.context_start + chunk.query_len
        keys = _gather(kv_pool.layer_view(layer, 0), chunk.block_table)[None, :, :context_len]
        values = _gather(kv_pool.layer_view(layer, 1), chunk.block_table)[None, :, :context_len]
        return keys, values

    def _prefill(self, q, k, v, kv_pool, layer: int, chunk: PrefillChunk, scale):
        # 4-D [1, heads, tokens, dim]: torch's CPU flash kernel takes only batched
        # inputs; 3-D ones fall back to the math path, 5-6x slower for a 256-token chunk.
        query = q.transpose(0, 1)[None]
        if chunk.context_start == 0:
            # A fresh prompt attends only to itself: its keys and values are in hand.
            out = F.scaled_dot_product_attention(
                query,
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
        else:
            keys, values = (kv.to(q.dtype) for kv in self._context(kv_pool, layer, chunk))
            context_len = chunk.context_start + chunk.query_len
            query_pos = torch.arange(chunk.query_len, device=q.device) + chunk.context_start
            key_pos = torch.arange(context_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)


def _gather(view: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., blocks] -> [..., kv_heads, tokens, head_dim] copy of the referenced blocks."""
    # index_select on the flattened table is ~6x faster than advanced indexing
    # on the strided per-layer view of the block-major pool.
    gathered = view.index_select(0, block_table.flatten())
    tokens = block_table.shape[-1] * view.shape[1]
    gathered = gathered.view(*block_table.shape[:-1], tokens, *view.shape[2:])
    return gathered.transpose(-3, -2)


def make_attention_backend(
    choice: AttentionChoice, dtype: torch.dtype, device: str, kernels: str = "auto"
) -> AttentionBackend:
    """The backend for `choice`; `auto` picks flash on CUDA when importable, the native
    kernels on CPU in float32 (unless `kernels` is 'torch'), else torch. An explicit
    choice that cannot run here raises."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention_backend must be one of {ATTENTION_CHOICES}, got {choice!r}")
    device_type = torch.device(device).type
    if choice in ("auto", "flash") and device_type == "cuda":
        from engine.flash_attention import FlashPagedAttention, flash_available

        if flash_available(dtype):
            return FlashPagedAttention()
    if choice == "flash":
        raise ValueError("attention_backend='flash' needs CUDA, fp16/bf16 and flash-attn")
    native_wanted = choice == "native" or (choice == "auto" and kernels != "torch")
    if native_wanted and device_type == "cpu" and dtype == torch.float32:
        from engine.native.attention import NativePagedAttention
        from engine.native.ops import native_kernels

        native = native_kernels()
        if native is not None:
            return NativePagedAttention(native)
    if choice == "native":
        raise ValueError("attention_backend='native' needs float32 on CPU and the kernels")
    return TorchPagedAttention()
