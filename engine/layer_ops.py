"""The handful of operations a decoder layer is written in, and the torch reference set.

`LlamaForward` runs every layer as: `norm_linear` (RMSNorm + qkv) -> `rope_store`
(rotate q, k and write k, v into the pool) -> attention -> `linear_add` (residual +=
o_proj) -> `norm_linear` (RMSNorm + gate|up) -> `glu_linear_add` (residual +=
down(silu(gate) * up)). Grouping them this way lets an implementation fuse each
group into one kernel call; the native float32 CPU set (`engine.native.ops`) does,
`TorchOps` spells them out in torch for every device and dtype.

Which set runs is chosen once per model by `make_layer_ops` (the `kernels` knob).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import KERNEL_CHOICES
from engine.config import Kernels as KernelChoice
from engine.linear import linear

__all__ = [
    "KERNEL_CHOICES",
    "HeadSizes",
    "KernelChoice",
    "Linear",
    "TorchOps",
    "activation_dtype",
    "glu",
    "make_layer_ops",
    "project",
    "rms_norm",
]
RESIDUAL_DTYPE = torch.float32


@dataclass
class Linear:
    """A projection's weight [out, in] and optional bias, as loaded from the checkpoint."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + extra


@dataclass(frozen=True)
class HeadSizes:
    """How a fused qkv row splits into heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def split(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]


class TorchOps:
    """Reference implementation in plain torch: any device, any dtype. The residual
    stream is float32 (see engine/model.py); matmuls run in the weights' dtype."""

    name = "torch"
    prepared_layout = "torch"
    """Names how `prepare_linear` lays weights out (the prepared-weight cache's key)."""

    def __init__(self, eps: float):
        self.eps = eps
        self.kv_store = _write_slots
        """Writes a step's new keys and values into the pool (`rope_store`)."""

    def use_kv_store(self, kv_store) -> None:
        """Store new keys and values with `kv_store(kv_pool, layer, meta, k, v)` instead of
        `KVCachePool.write_slots`; called once at load by `LlamaForward` with the attention
        backend's own store (the Triton kernel)."""
        self.kv_store = kv_store

    def prepare_linear(self, projection: Linear) -> Linear:
        """Called once per projection at load; returns what the other ops take."""
        return projection

    def begin_step(self) -> None:
        """Called by the model at the start of every forward step."""

    def embed(self, input_ids: torch.Tensor, table) -> torch.Tensor:
        return F.embedding(input_ids, table.weight).to(RESIDUAL_DTYPE)

    def norm(self, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the float32 residual, returned in the weights' dtype for the matmul."""
        shape = (residual.shape[-1],)
        if residual.dtype == weight.dtype:
            return F.rms_norm(residual, shape, weight, self.eps)
        # As transformers does: normalize in float32, scale in the weights' dtype.
        return F.rms_norm(residual, shape, None, self.eps).to(weight.dtype) * weight

    def project(self, x: torch.Tensor, projection: Linear) -> torch.Tensor:
        """x @ W^T (+ b): every projection of the ops below goes through here."""
        return linear(x, projection.weight, projection.bias)

    def norm_linear(self, residual, norm_weight, projection: Linear) -> torch.Tensor:
        normed = self.norm(residual, norm_weight)
        if normed.dtype != projection.weight.dtype:  # a float32 norm weight (Gemma's)
            normed = normed.to(projection.weight.dtype)
        return self.project(normed, projection)

    def linear_add(self, x, projection: Linear, residual: torch.Tensor) -> None:
        residual += self.project(x, projection)

    def glu_linear_add(self, gate_up, projection: Linear, residual: torch.Tensor) -> None:
        gate, up = gate_up.chunk(2, dim=-1)
        residual += self.project(F.silu(gate) * up, projection)

    def rope_store(self, qkv, positions, rope, kv_pool, layer: int, meta, sizes: HeadSizes):
        """Rotate q and k, write k and v into the pool; returns q, k, v as [T, heads, dim]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(sizes.split, dim=-1)
        q = q.view(num_tokens, sizes.num_heads, sizes.head_dim)
        k = k.view(num_tokens, sizes.num_kv_heads, sizes.head_dim)
        v = v.view(num_tokens, sizes.num_kv_heads, sizes.head_dim)
        q, k = rope.apply(q, k, positions)
        self.kv_store(kv_pool, layer, meta, k, v)
        return q, k, v


def _write_slots(kv_pool, layer: int, meta, k, v) -> None:
    kv_pool.write_slots(layer, meta.slot_blocks, meta.slot_offsets, k, v)


def project(ops, x: torch.Tensor, projection) -> torch.Tensor:
    """x @ W^T (+ b) on either op set: the projections a layer needs outside the grouped
    ops (MoE router and experts, Gemma's normed outputs). The native set has no plain
    projection, so it accumulates into zeros."""
    if ops.name == "torch":
        if x.dtype != projection.weight.dtype:  # float32 norm output into bf16 weights
            x = x.to(projection.weight.dtype)
        return ops.project(x, projection)
    out = torch.zeros(x.shape[0], projection.out_features, dtype=RESIDUAL_DTYPE)
    ops.linear_add(x.contiguous(), projection, out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in `x`'s dtype: a float32 weight (Gemma's
    1 + w) scales in float32 as Gemma does; another scales in its own dtype as Llama's."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if weight.dtype == torch.float32:
        return (normed * weight).to(x.dtype)
    return (normed.to(weight.dtype) * weight).to(x.dtype)


GLU_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda gate: F.gelu(gate, approximate="tanh"),
}


def glu(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a stacked [gate | up] row."""
    gate, up = gate_up.chunk(2, dim=-1)
    return GLU_ACTIVATIONS[activation](gate) * up


def make_layer_ops(
    choice: KernelChoice, dtype: torch.dtype, device: str, eps: float, deterministic: bool = False
):
    """`native` where it applies, else `TorchOps`: on CPU with the kernels compiled, in
    float32, and in bfloat16 where the CPU has AVX512-BF16 (bf16 weights, float32
    activations: `activation_dtype`; the KV pool's dtype is the model's own, see
    `LlamaForward.kv_dtype`; multi-row projections on AMX tiles where
    the CPU has those too).

    `auto` falls back quietly; an explicit `native` that cannot run raises.
    `deterministic`: the native kernels in their batch-invariant mode, or torch ops
    whose projections and norms run on the batch-invariant Triton kernels
    (engine/invariant_ops.py); where neither can run, ValueError."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "torch":
        return _torch_ops(eps, device, deterministic)
    kernels = _native_kernels_for(dtype, device)
    if kernels is not None:
        from engine.native.ops import NativeOps

        return NativeOps(kernels, eps, dtype == torch.bfloat16, deterministic)
    if choice == "native":
        raise ValueError(
            "kernels='native' cannot run here: they need a C compiler and a CPU, in float32 "
            "(or bfloat16 on a CPU with AVX512-BF16)"
        )
    return _torch_ops(eps, device, deterministic)


def _torch_ops(eps: float, device: str, deterministic: bool) -> TorchOps:
    if not deterministic:
        return TorchOps(eps)
    from engine.invariant_ops import InvariantTorchOps, invariant_ops_run_on

    reason = invariant_ops_run_on(device)
    if reason:
        raise ValueError(
            f"deterministic mode cannot run torch layer ops here ({reason}): their matmuls "
            "take other paths at other batch sizes. On a CPU it needs the native kernels "
            "(kernels auto or native, and a C compiler)"
        )
    return InvariantTorchOps(eps)


def activation_dtype(choice: KernelChoice, dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype of the activations of a model run in `dtype`: float32 where the native
    kernels run it on bf16 weights, `dtype` otherwise."""
    if choice != "torch" and _native_kernels_for(dtype, device) is not None:
        return torch.float32
    return dtype


def _native_kernels_for(dtype: torch.dtype, device: str):
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    from engine.native.ops import native_kernels

    kernels = native_kernels()
    if kernels is None or dtype == torch.float32:
        return kernels
    return kernels if kernels.bf16 else None
