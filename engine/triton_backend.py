"""The Triton attention backend: the GPU path, reading the KV pool in place.

Picked by `make_attention_backend('triton')`, and by `auto` on CUDA where neither
FlashInfer nor flash-attn serves the model. Per layer of a step: `TorchOps.rope_store`
writes the new keys and values through `kv_store` (engine/kernels/triton_kv_store.py),
then `forward` runs the step's decode rows in one launch and all its prefill chunks
in another (engine/kernels/triton_attention.py), each over the blocks where they lie,
at any block size. The decode launch reads only the metadata's tensors (no host
synchronisation), so it is captured into the decode CUDA graphs as is.

On a CPU the same kernels run under Triton's interpreter when TRITON_INTERPRET=1 was
set before triton was imported: slow, and meant only to prove the GPU path correct
(`pdserve generate --attention-backend triton`, the tests).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from engine import envs
from engine.attention import AttentionBackend, AttentionMetadata


def triton_runs_on(device: str) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None where they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    device_type = torch.device(device).type
    if device_type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device"
    if device_type == "cpu":
        if envs.triton_interpret():
            return None
        return "on a CPU it runs in Triton's interpreter: set TRITON_INTERPRET=1 first"
    return f"no Triton target for device {device!r}"


@functools.cache
def _kernels():
    """The kernel modules, imported on first use (the engine imports without triton)."""
    from engine.kernels import triton_attention, triton_kv_store

    return triton_attention, triton_kv_store


def store_kv(kv_pool, layer: int, meta: AttentionMetadata, k, v) -> None:
    """`AttentionBackend.kv_store`: the step's new keys and values into their slots."""
    _, kv_store = _kernels()
    kv_store.store_kv(
        k,
        v,
        kv_pool.layer_view(layer, 0),
        kv_pool.layer_view(layer, 1),
        meta.slot_blocks,
        meta.slot_offsets,
    )


class TritonPagedAttention(AttentionBackend):
    """Decode rows and prefill chunks (fresh or after cached context) on the Triton
    kernels, GQA and sliding windows included, any device triton targets.
    `deterministic`: no split decode rows, prefill on decode's row block, so a row's bits
    depend neither on its batch nor on how its prompt was chunked
    (engine/kernels/triton_attention.py)."""

    name = "triton"
    reads_in_place = True
    kv_store = staticmethod(store_kv)

    def __init__(self, deterministic: bool = False):
        self.deterministic = deterministic

    def forward(self, q, k, v, kv_pool, layer, meta, scale, window: int | None = None):
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        decode_count = meta.num_decode_tokens
        if decode_count:
            self._decode(q[:decode_count], kv_pool, layer, meta, scale, out[:decode_count], window)
        if meta.prefill_chunks:
            self._prefill(q, k, v, kv_pool, layer, meta, scale, out, window)
        return out

    def _decode(self, q, kv_pool, layer: int, meta, scale, out, window) -> None:
        attention, _ = _kernels()
        attention.decode_attention(
            q,
            kv_pool.layer_view(layer, 0),
            kv_pool.layer_view(layer, 1),
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            out,
            window=window,
            deterministic=self.deterministic,
        )

    def _prefill(self, q, k, v, kv_pool, layer: int, meta, scale, out, window) -> None:
        """Every prefill chunk of the step, in one launch (rows after the decode rows)."""
        attention, _ = _kernels()
        attention.prefill_attention(
            q,
            kv_pool.layer_view(layer, 0),
            kv_pool.layer_view(layer, 1),
            meta.prefill_batch,
            scale,
            out,
            window=window,
            deterministic=self.deterministic,
        )
