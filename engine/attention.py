"""Paged attention over the KV pool, and the seam where other kernels plug in.

One forward step packs the new tokens of many sequences into one row-major batch:
decode tokens first (one per sequence), then prefill chunks. Keys and values of the
new tokens are written into the pool before attention (`rope_store`, through the
backend's `kv_store` where it has one), so a decode row or a later prefill chunk reads
earlier tokens from the same cache.

`AttentionBackend` is the seam: a backend sees the same metadata and the pool, and is
picked by name (`make_attention_backend`, the `attention_backend` setting):

- `triton` (engine/triton_backend.py): the GPU kernels, reading the blocks in place at
  any block size, decode and prefill chunks alike (also on a CPU, under Triton's
  interpreter: the debug mode that drives the GPU path here);
- `flashinfer`, `flash_attn` (alias `flash`): those libraries on CUDA where they are
  importable, the Triton kernels for what they cannot serve;
- `native` (engine/native/attention.py): the float32 CPU kernels, in place;
- `torch` (`TorchPagedAttention`): gathers a row's blocks into a dense copy and runs
  SDPA. The reference the others are tested against; on CUDA only when named.
"""

from __future__ import annotations

import functools
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


@dataclass(frozen=True)
class SeqBatch:
    """Sequences whose query rows attend over the paged pool, as one kernel launch takes
    them. Row r of the step belongs to sequence s when query_starts[s] <= r <
    query_starts[s + 1]; sequence s has seq_lens[s] tokens in the pool, its queries the
    last of them, and its blocks are block_tables[s]."""

    query_starts: torch.Tensor
    """[num_seqs + 1] first query row of each sequence, then the end of the last."""
    seq_lens: torch.Tensor
    """[num_seqs] tokens of each sequence in the pool, this step's included."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] block ids (entries past a sequence's blocks are never read)."""
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


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

    @functools.cached_property
    def prefill_batch(self) -> SeqBatch:
        """The prefill chunks as one `SeqBatch`, built on the first layer's call and reused
        by the others (chunks are packed back to back, as `ModelRunner` lays them out)."""
        chunks = self.prefill_chunks
        device = self.slot_blocks.device
        starts = [c.query_start for c in chunks] + [chunks[-1].query_start + chunks[-1].query_len]
        if any(c.query_start + c.query_len != s for c, s in zip(chunks, starts[1:], strict=True)):
            raise ValueError("prefill chunks must be packed back to back")
        width = max(c.block_table.shape[0] for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.long, device=device)
        for row, chunk in enumerate(chunks):
            tables[row, : chunk.block_table.shape[0]] = chunk.block_table
        return SeqBatch(
            query_starts=torch.tensor(starts, dtype=torch.long, device=device),
            seq_lens=torch.tensor(
                [c.context_start + c.query_len for c in chunks], dtype=torch.long, device=device
            ),
            block_tables=tables,
            max_query_len=max(c.query_len for c in chunks),
        )


class AttentionBackend:
    """Attention of one layer of one packed step; called by the model once per layer,
    after the step's new keys and values are in the pool."""

    name = "base"
    reads_in_place = False
    """True where decode reads the pool through the block table whatever its width (a
    captured decode graph then needs one table width, not one per width bucket)."""
    kv_store = None
    """The backend's own store of new keys and values (`TorchOps.rope_store` calls it as
    kv_store(kv_pool, layer, meta, k, v)); None: `KVCachePool.write_slots`."""

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
    """Reference backend on torch SDPA with GQA, any device and dtype. Subclasses that
    run their own kernels override `_decode` and `_prefill`; a window that cuts a row's
    context always takes this class's masked path."""

    name = "torch"

    def forward(
        self, q, k, v, kv_pool, layer, meta, scale, window: int | None = None, softcap=None
    ):
        if softcap is not None:
            from engine.masked_attention import masked_attention

            return masked_attention(q, k, v, kv_pool, layer, meta, scale, window, softcap)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        decode_count = meta.num_decode_tokens
        if decode_count:
            rows = (q[:decode_count], kv_pool, layer, meta, scale, out[:decode_count])
            if not _window_cuts(meta.decode_context_lens, window):
                self._decode(*rows)
            else:
                TorchPagedAttention._decode(self, *rows, window=window)
        for chunk in meta.prefill_chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            args = (q[rows], k[rows], v[rows], kv_pool, layer, chunk, scale)
            if window is None or chunk.context_start + chunk.query_len <= window:
                attended = self._prefill(*args)
            else:
                attended = TorchPagedAttention._prefill(self, *args, window=window)
            out[rows] = attended.reshape(chunk.query_len, num_heads * head_dim)
        return out

    def _decode(self, q, kv_pool, layer, meta, scale, out, window: int | None = None) -> None:
        # .to: a bf16 pool under float32 activations (the native kernels' fallback here)
        keys = _gather(kv_pool.layer_view(layer, 0), meta.decode_block_tables).to(q.dtype)
        values = _gather(kv_pool.layer_view(layer, 1), meta.decode_block_tables).to(q.dtype)
        positions = torch.arange(keys.shape[-2], device=q.device)
        context_lens = meta.decode_context_lens[:, None]
        mask = positions[None, :] < context_lens
        if window is not None:
            mask &= positions[None, :] >= context_lens - window
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

    def _prefill(self, q, k, v, kv_pool, layer, chunk, scale, window: int | None = None):
        # 4-D [1, heads, tokens, dim]: torch's CPU flash kernel takes only batched
        # inputs; 3-D ones fall back to the math path, 5-6x slower for a 256-token chunk.
        query = q.transpose(0, 1)[None]
        if chunk.context_start == 0 and window is None:
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
            if window is not None:
                mask &= query_pos[:, None] - key_pos[None, :] < window
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)


def _window_cuts(context_lens: torch.Tensor, window: int | None) -> bool:
    """Whether a window hides keys from some decode row. On a device, assumed (the masked
    path is exact either way, and reading the lengths would stall, or break a capture)."""
    if window is None:
        return False
    return context_lens.device.type != "cpu" or int(context_lens.max()) > window


def _gather(view: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., blocks] -> [..., kv_heads, tokens, head_dim] copy of the referenced blocks."""
    # index_select on the flattened table is ~6x faster than advanced indexing
    # on the strided per-layer view of the block-major pool.
    gathered = view.index_select(0, block_table.flatten())
    tokens = block_table.shape[-1] * view.shape[1]
    gathered = gathered.view(*block_table.shape[:-1], tokens, *view.shape[2:])
    return gathered.transpose(-3, -2)


DETERMINISTIC_BACKENDS = ("native", "triton")
"""Backends whose rows do not depend on their batch (`deterministic`)."""


def make_attention_backend(
    choice: AttentionChoice,
    dtype: torch.dtype,
    device: str,
    kernels: str = "auto",
    block_size: int = 16,
    deterministic: bool = False,
) -> AttentionBackend:
    """The backend for `choice`. `auto`: on CUDA FlashInfer or flash-attn where importable
    and able to serve `dtype` and `block_size`, else the Triton kernels; on a CPU the
    native kernels in float32 (unless `kernels` is 'torch'), else torch. The torch gather
    path runs on CUDA only when named. An explicit choice that cannot run here raises.
    `deterministic`: only `DETERMINISTIC_BACKENDS`, in their batch-invariant mode (`auto`
    on CUDA is then Triton); anything else raises."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention_backend must be one of {ATTENTION_CHOICES}, got {choice!r}")
    choice = "flash_attn" if choice == "flash" else choice
    backend = _backend(choice, dtype, device, kernels, block_size, deterministic)
    if deterministic and backend.name not in DETERMINISTIC_BACKENDS:
        raise ValueError(
            f"deterministic mode needs attention_backend native (float32 on CPU, with the "
            f"native kernels) or triton; {backend.name!r} rows depend on their batch"
        )
    return backend


def _backend(choice, dtype, device, kernels, block_size, deterministic) -> AttentionBackend:
    if choice == "torch":
        return TorchPagedAttention()
    if torch.device(device).type == "cuda":
        return _cuda_backend(choice, dtype, block_size, deterministic)
    if choice in ("flashinfer", "flash_attn"):
        raise ValueError(f"attention_backend={choice!r} needs CUDA")
    if choice == "triton":
        from engine.triton_backend import TritonPagedAttention, triton_runs_on

        reason = triton_runs_on(device)
        if reason:
            raise ValueError(f"attention_backend='triton' cannot run here: {reason}")
        return TritonPagedAttention(deterministic)
    native_wanted = choice == "native" or kernels != "torch"
    if native_wanted and dtype == torch.float32 and torch.device(device).type == "cpu":
        from engine.native.attention import NativePagedAttention
        from engine.native.ops import native_kernels

        native = native_kernels()
        if native is not None:
            return NativePagedAttention(native, deterministic)
    if choice == "native":
        raise ValueError("attention_backend='native' needs float32 on CPU and the kernels")
    return TorchPagedAttention()


def _cuda_backend(
    choice: str, dtype: torch.dtype, block_size: int, deterministic: bool = False
) -> AttentionBackend:
    """`auto`, `triton`, `flashinfer` or `flash_attn` on a CUDA device; `auto` is Triton
    in deterministic mode."""
    if choice == "native":
        raise ValueError("attention_backend='native' needs float32 on CPU and the kernels")
    searching = choice == "auto" and not deterministic
    if choice == "flashinfer" or searching:
        from engine.flashinfer_backend import FlashInferPagedAttention, flashinfer_available

        if flashinfer_available(dtype, block_size):
            return FlashInferPagedAttention()
        if choice == "flashinfer":
            raise ValueError("attention_backend='flashinfer' needs fp16/bf16 and flashinfer")
    if choice == "flash_attn" or searching:
        from engine.flash_attention import FlashPagedAttention, flash_available

        explicit = choice == "flash_attn"
        if flash_available(dtype) and (explicit or FlashPagedAttention.pages(block_size)):
            return FlashPagedAttention()
        if choice == "flash_attn":
            raise ValueError("attention_backend='flash_attn' needs fp16/bf16 and flash-attn")
    from engine.triton_backend import TritonPagedAttention, triton_runs_on

    reason = triton_runs_on("cuda")
    if reason:
        raise ValueError(f"no CUDA attention backend can run here: {reason}")
    return TritonPagedAttention(deterministic)
