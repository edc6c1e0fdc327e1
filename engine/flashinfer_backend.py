"""FlashInfer behind `AttentionBackend`, on CUDA when `flashinfer` is importable.

Picked by `make_attention_backend('flashinfer')`, and by `auto` on a CUDA device with
fp16/bf16 where it is importable (it pages at any block size, 16 included). Per step,
the first layer plans the step's decode rows and prefill chunks once (FlashInfer's
`plan`: page-table CSR built on the device, its schedule on the host); every layer
then runs the planned wrappers over its keys and values in place (the pool's
block-major layout is a strided NHD page table, which FlashInfer reads through its
strides). A plan reads lengths on the host, so it cannot be captured: decode inside a
CUDA-graph capture, sliding windows and head dims FlashInfer does not build run on the
Triton kernels of the base class.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from engine.triton_backend import TritonPagedAttention

WORKSPACE_BYTES = 128 << 20
HEAD_DIMS = (64, 128, 256)


@functools.cache
def flashinfer_available(dtype: torch.dtype, block_size: int) -> bool:
    """fp16/bf16 on CUDA with flashinfer importable; any block size pages."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and block_size > 0
        and torch.cuda.is_available()
        and importlib.util.find_spec("flashinfer") is not None
    )


def page_table(tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """FlashInfer's CSR page table (indptr, indices, last_page_len; int32) of padded block
    tables [n, width] and the tokens of each row."""
    pages = (seq_lens + page_size - 1) // page_size
    used = torch.arange(tables.shape[1], device=tables.device)[None, :] < pages[:, None]
    indptr = torch.zeros(tables.shape[0] + 1, dtype=torch.int32, device=tables.device)
    indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = seq_lens - (pages - 1) * page_size
    return indptr, tables[used].to(torch.int32), last_page_len.to(torch.int32)


class FlashInferPagedAttention(TritonPagedAttention):
    """CUDA backend: FlashInfer's paged decode and prefill, the Triton kernels for what
    it does not serve."""

    name = "flashinfer"

    def __init__(self):
        import flashinfer

        self.flashinfer = flashinfer
        self.wrappers = None
        self.planned = None
        """The metadata of the step the wrappers are planned for."""

    def _serves(self, q, window) -> bool:
        capturing = torch.cuda.is_current_stream_capturing()
        return window is None and not capturing and q.shape[-1] in HEAD_DIMS

    def _decode(self, q, kv_pool, layer: int, meta, scale, out, window) -> None:
        if not self._serves(q, window):
            return super()._decode(q, kv_pool, layer, meta, scale, out, window)
        decode, _ = self._plan(q, kv_pool, meta, scale)
        attended = decode.run(q, _pages(kv_pool, layer))
        out.copy_(attended.flatten(1))

    def _prefill(self, q, k, v, kv_pool, layer: int, meta, scale, out, window) -> None:
        if not self._serves(q, window):
            return super()._prefill(q, k, v, kv_pool, layer, meta, scale, out, window)
        _, prefill = self._plan(q, kv_pool, meta, scale)
        chunks = meta.prefill_chunks
        rows = slice(chunks[0].query_start, chunks[-1].query_start + chunks[-1].query_len)
        out[rows] = prefill.run(q[rows], _pages(kv_pool, layer)).flatten(1)

    def _plan(self, q, kv_pool, meta, scale):
        """The step's planned (decode, prefill) wrappers, planned on its first layer."""
        if self.wrappers is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self.wrappers = (
                self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=True
                ),
                self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"),
            )
        if self.planned is not meta:
            self._plan_step(q, kv_pool, meta, scale)
            self.planned = meta
        return self.wrappers

    def _plan_step(self, q, kv_pool, meta, scale) -> None:
        decode, prefill = self.wrappers
        page_size = kv_pool.block_size
        keys = kv_pool.layer_view(0, 0)
        shape = dict(
            num_qo_heads=q.shape[1],
            num_kv_heads=keys.shape[2],
            head_dim=q.shape[2],
            page_size=page_size,
        )
        dtypes = dict(q_data_type=q.dtype, kv_data_type=keys.dtype, sm_scale=scale)
        if meta.num_decode_tokens:
            tables = page_table(meta.decode_block_tables, meta.decode_context_lens, page_size)
            decode.plan(*tables, **shape, pos_encoding_mode="NONE", **dtypes)
        if meta.prefill_chunks:
            batch = meta.prefill_batch
            starts = (batch.query_starts - batch.query_starts[0]).to(torch.int32)
            tables = page_table(batch.block_tables, batch.seq_lens, page_size)
            head_dim = shape.pop("head_dim")
            prefill.plan(starts, *tables, **shape, head_dim_qk=head_dim, causal=True, **dtypes)


def _pages(kv_pool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys and values as FlashInfer's NHD pages [blocks, block_size, Hkv, D]."""
    return kv_pool.layer_view(layer, 0), kv_pool.layer_view(layer, 1)
