"""Reference attention for layers with a sliding window or soft-capped scores.

`TorchPagedAttention.forward` (and every backend that inherits it) comes here when a
layer passes `window` or `softcap`:

- window: a query at position p sees keys at positions in (p - window, p]. Only the
  blocks that hold such keys are gathered, so a long sequence's decode step reads
  about `window` tokens, and blocks before them may be gone (freed, their ids in the
  block table placeholders: `engine.sliding_window`).
- softcap: scores become cap * tanh(score / cap) before the mask and softmax (Gemma 2);
  SDPA has no such hook, so those layers run the matmuls spelled out, as
  transformers' eager attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import _gather


def masked_attention(q, k, v, kv_pool, layer: int, meta, scale: float, window, softcap):
    """Same contract as `AttentionBackend.forward`: q [T, Hq, D], k, v [T, Hkv, D] of the
    step's new tokens (already in the pool); returns [T, Hq * D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    decode_count = meta.num_decode_tokens
    if decode_count:
        out[:decode_count] = _decode(q[:decode_count], kv_pool, layer, meta, scale, window, softcap)
    for chunk in meta.prefill_chunks:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        attended = _prefill(
            q[rows], k[rows], v[rows], kv_pool, layer, chunk, scale, window, softcap
        )
        out[rows] = attended.reshape(chunk.query_len, num_heads * head_dim)
    return out


def _decode(q, kv_pool, layer, meta, scale, window, softcap) -> torch.Tensor:
    lens = meta.decode_context_lens
    size = kv_pool.block_size
    first_block = 0
    if window is not None:
        first_block = int((lens - window).clamp(min=0).min()) // size
    tables = meta.decode_block_tables[:, first_block:]
    keys, values = (_gather(kv_pool.layer_view(layer, kind), tables).to(q.dtype) for kind in (0, 1))
    positions = torch.arange(keys.shape[-2], device=q.device) + first_block * size
    mask = positions[None, :] < lens[:, None]
    if window is not None:
        mask &= positions[None, :] > lens[:, None] - 1 - window
    attended = attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap)
    return attended.flatten(1)


def _prefill(q, k, v, kv_pool, layer, chunk, scale, window, softcap) -> torch.Tensor:
    query = q.transpose(0, 1)[None]
    query_pos = torch.arange(chunk.query_len, device=q.device) + chunk.context_start
    if chunk.context_start == 0:  # a fresh prompt: its keys and values are in hand
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        key_pos = query_pos
    else:
        size = kv_pool.block_size
        first_block = 0 if window is None else max(0, chunk.context_start - window + 1) // size
        context_len = chunk.context_start + chunk.query_len
        table = chunk.block_table[first_block:]
        count = context_len - first_block * size
        keys, values = (
            _gather(kv_pool.layer_view(layer, kind), table)[None, :, :count].to(q.dtype)
            for kind in (0, 1)
        )
        key_pos = torch.arange(count, device=q.device) + first_block * size
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return attend(query, keys, values, mask, scale, softcap)[0].transpose(0, 1)


def attend(query, keys, values, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """query [B, Hq, Lq, D] over keys/values [B, Hkv, Lk, D] (GQA), `mask` True where a
    query sees a key (broadcast to [B, Hq, Lq, Lk])."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    group = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, values)
