"""A whole decode step in one native call (`pd_decode_step` in decode_step.c).

When a model's layer ops and attention are both native, decode-only steps come here:
the embedding, every layer, the LM head and each row's greedy token then run in one C
call and one OpenMP parallel region, instead of ~150 calls with their Python glue
(~70 us per layer, a tenth of a batch-1 step). Prefill and mixed steps keep the
operation-by-operation path, where that overhead is noise next to the matmuls.

The engine's path (`ModelRunner` -> `LlamaForward.decode`) hands the step over as plain
ints (`DecodeRows`) and gets the logits in a buffer kept across steps: a batch-1 step's
Python runs on caches its 538 MB weight stream has just flushed, where even one small
`torch.tensor` took ~130 us, against ~30 us for the same lists in plain Python.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass

import torch

from engine.native.bindings import SCRATCH_BUFFERS, DecodeBatch, LayerWeights, Model
from engine.native.ops import NativeKernels, PackedLinear


@dataclass
class DecodeRows:
    """A decode-only step as plain ints, row r being one sequence's next token: what the
    fused step reads. `ModelRunner` builds it from the scheduler's chunks."""

    tokens: list[int]
    positions: list[int]
    slot_blocks: list[int]
    slot_offsets: list[int]
    """Where each row's new key and value go: pool block and offset in it."""
    context_lens: list[int]
    """Tokens each row attends to, its new one included."""
    block_tables: list[list[int]]
    """Each row's blocks, all padded to one width (block 0: masked by the context length)."""

    @classmethod
    def of_step(cls, input_ids, positions, meta) -> DecodeRows:
        """The rows of a packed decode-only step's tensors (`LlamaForward.forward`)."""
        return cls(
            input_ids.tolist(),
            positions.tolist(),
            meta.slot_blocks.tolist(),
            meta.slot_offsets.tolist(),
            meta.decode_context_lens.tolist(),
            meta.decode_block_tables.tolist(),
        )


@dataclass
class FusedStep:
    logits: torch.Tensor
    """[rows, vocab] float32, in `FusedDecode`'s buffer: valid until its next step."""
    greedy: list[int]
    """Each row's first largest logit (numpy's argmax, the first NaN where there is one)."""


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class FusedDecode:
    """Built once per model, after its weights are packed; `run` per decode-only step."""

    def __init__(self, kernels: NativeKernels, model):
        self.kernels = kernels
        spec, weights = model.spec, model.weights
        self.spec = spec
        self.qkv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        self._layers = (LayerWeights * spec.num_layers)(*map(_layer_struct, weights.layers))
        embed = weights.embed
        self.model = Model(
            spec.num_layers,
            spec.hidden_size,
            spec.intermediate_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.vocab_size,
            spec.rms_norm_eps,
            model.scale,
            self._layers,
            weights.final_norm.data_ptr(),
            weights.lm_head.packed.data_ptr(),
            None if isinstance(embed, PackedLinear) else embed.weight.data_ptr(),
            model.rope.cos.data_ptr(),
            model.rope.sin.data_ptr(),
            int(weights.lm_head.bf16),
            int(model.deterministic),
        )
        self._weights = weights  # keeps every tensor the structs point into alive
        self._scratch_rows = 0
        self._scratch_tensors: list[torch.Tensor] = []
        self._scratch_addresses: tuple[int, ...] = ()
        self._ints = (ctypes.c_int64 * 0)()
        self._greedy = (ctypes.c_int64 * 0)()
        self._logits = torch.empty(0, spec.vocab_size)
        self._logits_address = 0
        self._logit_rows: dict[int, torch.Tensor] = {}
        self._pool_kv: torch.Tensor | None = None
        self._pool_fields: tuple = ()
        self._pool_bf16 = False

    def run(self, rows: DecodeRows, kv_pool, threads: int) -> FusedStep | None:
        """The step's logits and greedy tokens, on `threads` threads; None if the kernel
        declines the shapes (the caller then runs the step operation by operation).
        No torch call unless a buffer has to grow: see the module's docstring."""
        count, width = len(rows.tokens), len(rows.block_tables[0])
        ints = self._int_buffer(count * (5 + width))
        flat = [
            *rows.tokens,
            *rows.positions,
            *rows.slot_blocks,
            *rows.slot_offsets,
            *rows.context_lens,
            *itertools.chain.from_iterable(rows.block_tables),
        ]
        ints[: len(flat)] = flat
        base, size = ctypes.addressof(ints), ctypes.sizeof(ctypes.c_int64)
        tokens, positions, blocks, offsets, lens, tables = (
            base + part * count * size for part in range(6)
        )
        pool = self._pool(kv_pool)
        batch = DecodeBatch(
            count,
            tokens,
            positions,
            blocks,
            offsets,
            tables,
            lens,
            width,
            *pool,
            *self._scratch(count),
            self._logits_buffer(count),
            self._pool_bf16,
            ctypes.addressof(self._greedy),
        )
        if self.kernels.decode_step(
            m=ctypes.byref(self.model), b=ctypes.byref(batch), nthreads=threads
        ):
            return None
        return FusedStep(self._logit_rows[count], self._greedy[:count])

    def _int_buffer(self, length: int) -> ctypes.Array:
        if length > len(self._ints):
            self._ints = (ctypes.c_int64 * (2 * length))()
        return self._ints

    def _logits_buffer(self, rows: int) -> int:
        """Address of the logits buffer, grown to `rows` (with the greedy tokens')."""
        if rows > len(self._greedy):
            self._logits = torch.empty(rows, self.spec.vocab_size)
            self._logits_address = self._logits.data_ptr()
            self._logit_rows = {}
            self._greedy = (ctypes.c_int64 * rows)()
        if rows not in self._logit_rows:
            self._logit_rows[rows] = self._logits[:rows]
        return self._logits_address

    def _pool(self, kv_pool) -> tuple:
        """The pool's address, strides and block size, looked up again only when its tensor
        changes (a worker moves it into shared memory once)."""
        kv = kv_pool.kv
        if kv is not self._pool_kv:
            self._pool_kv, self._pool_fields = kv, (kv.data_ptr(), *kv.stride()[:3], kv.shape[3])
            self._pool_bf16 = kv_pool.holds_bf16
        return self._pool_fields

    def _scratch(self, rows: int) -> tuple[int, ...]:
        """Addresses of the step's scratch buffers (every buffer but the logits), kept for
        the most rows a step has had: the kernel reads them row by row at their widths,
        so a larger buffer serves a smaller step, and steps of one engine run one at a
        time."""
        if rows > self._scratch_rows:
            spec = self.spec
            widths = {
                "residual": spec.hidden_size,
                "qkv": self.qkv_width,
                "attn": spec.num_heads * spec.head_dim,
                "gate_up": 2 * spec.intermediate_size,
                "scratch": max(spec.hidden_size, spec.intermediate_size),
            }
            self._scratch_tensors = [torch.empty(rows, widths[n]) for n in SCRATCH_BUFFERS]
            self._scratch_addresses = tuple(t.data_ptr() for t in self._scratch_tensors)
            self._scratch_rows = rows
        return self._scratch_addresses


def _layer_struct(layer) -> LayerWeights:
    return LayerWeights(
        layer.input_norm.data_ptr(),
        layer.post_norm.data_ptr(),
        layer.qkv.packed.data_ptr(),
        _address(layer.qkv.bias),
        layer.o_proj.packed.data_ptr(),
        _address(layer.o_proj.bias),
        layer.gate_up.packed.data_ptr(),
        layer.down.packed.data_ptr(),
    )
