"""A whole decode step in one native call (`pd_decode_step` in decode_step.c).

`LlamaForward.forward` hands decode-only steps here when both its layer ops and its
attention are native: the embedding, every layer and the LM head then run in one
C call and one OpenMP parallel region, instead of ~150 calls with their Python glue
(~70 us per layer, a tenth of a batch-1 step). Prefill and mixed steps keep the
operation-by-operation path, where that overhead is noise next to the matmuls.
"""

from __future__ import annotations

import ctypes

import torch

from engine.native.ops import NativeKernels, PackedLinear

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "o_proj",
            "o_bias",
            "gate_up",
            "down",
        )
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _L) for name in ("num_layers", "hidden", "intermediate", "num_heads")),
        *((name, _L) for name in ("num_kv_heads", "head_dim", "vocab")),
        ("eps", _F),
        ("scale", _F),
        ("layers", ctypes.POINTER(_LayerWeights)),
        *((name, _P) for name in ("final_norm", "lm_head", "embed", "rope_cos", "rope_sin")),
        ("weights_bf16", ctypes.c_int),
    ]


_BATCH_POINTERS = ("tokens", "positions", "slot_blocks", "slot_offsets", "block_tables")
_SCRATCH_BUFFERS = ("residual", "qkv", "attn", "gate_up", "scratch")
_BATCH_BUFFERS = (*_SCRATCH_BUFFERS, "logits")


class _DecodeBatch(ctypes.Structure):
    _fields_ = [
        ("rows", _L),
        *((name, _P) for name in (*_BATCH_POINTERS, "context_lens")),
        ("table_stride", _L),
        ("kv", _P),
        *((name, _L) for name in ("block_stride", "layer_stride", "kind_stride", "block_size")),
        *((name, _P) for name in _BATCH_BUFFERS),
        ("kv_bf16", ctypes.c_int),
    ]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class FusedDecode:
    """Built once per model, after its weights are packed; `run` per decode-only step."""

    def __init__(self, kernels: NativeKernels, model):
        self.kernels = kernels
        self.library = kernels.library
        self.library.pd_decode_step.argtypes = [
            ctypes.POINTER(_Model),
            ctypes.POINTER(_DecodeBatch),
            ctypes.c_int,
        ]
        self.library.pd_decode_step.restype = ctypes.c_int
        spec, weights = model.spec, model.weights
        self.spec = spec
        self.qkv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        self._layers = (_LayerWeights * spec.num_layers)(*map(_layer_struct, weights.layers))
        embed = weights.embed
        self.model = _Model(
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
        )
        self._weights = weights  # keeps every tensor the structs point into alive
        self._scratch_rows = 0
        self._scratch_tensors: list[torch.Tensor] = []
        self._scratch_addresses: tuple[int, ...] = ()

    def run(self, input_ids, positions, meta, kv_pool) -> torch.Tensor | None:
        """Logits [rows, vocab] of a step whose rows all decode; None if the kernel
        declines the shapes (the caller then runs the step operation by operation)."""
        rows = input_ids.shape[0]
        buffers = self._scratch(rows)
        logits = torch.empty(rows, self.spec.vocab_size)  # the caller keeps it
        kv, tables = kv_pool.kv, meta.decode_block_tables
        batch = _DecodeBatch(
            rows,
            input_ids.data_ptr(),
            positions.data_ptr(),
            meta.slot_blocks.data_ptr(),
            meta.slot_offsets.data_ptr(),
            tables.data_ptr(),
            meta.decode_context_lens.data_ptr(),
            tables.stride(0),
            kv.data_ptr(),
            *kv.stride()[:3],
            kv.shape[3],
            *buffers,
            logits.data_ptr(),
            kv_pool.holds_bf16,
        )
        threads = torch.get_num_threads()
        status = self.library.pd_decode_step(ctypes.byref(self.model), ctypes.byref(batch), threads)
        return None if status else logits

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
            self._scratch_tensors = [torch.empty(rows, widths[n]) for n in _SCRATCH_BUFFERS]
            self._scratch_addresses = tuple(t.data_ptr() for t in self._scratch_tensors)
            self._scratch_rows = rows
        return self._scratch_addresses


def _layer_struct(layer) -> _LayerWeights:
    return _LayerWeights(
        layer.input_norm.data_ptr(),
        layer.post_norm.data_ptr(),
        layer.qkv.packed.data_ptr(),
        _address(layer.qkv.bias),
        layer.o_proj.packed.data_ptr(),
        _address(layer.o_proj.bias),
        layer.gate_up.packed.data_ptr(),
        layer.down.packed.data_ptr(),
    )
