"""Batch-invariant projections and RMSNorm in Triton: the GPU path's deterministic mode.

`InvariantTorchOps` (engine/invariant_ops.py) calls `matmul` for every projection and
`rms_norm` for every norm of a model run with `deterministic`. cuBLAS picks its kernel
(tile shape, split-K) by the matrix shapes, so a row of a projection gets other bits at
another batch size; ATen's row reductions spread a row over more threads when there are
few rows. Here the arithmetic of each output element is fixed whatever the number of
rows, as vLLM's batch-invariant mode fixes it:

- `matmul`: one tile shape (BLOCK_M x BLOCK_N, K in BLOCK_K steps) for every launch; a
  program owns one output tile and sums K in order, into one float32 accumulator (no
  split-K, no shape-dependent choice). A row's values do not depend on the rows beside
  it (padding rows are masked zeros) nor on its place in the tile, which a tensor
  core's dot does not see; under the interpreter, whose dot is numpy's BLAS (it does),
  each product is summed over k element by element instead.
- `rms_norm`: one program per row, its sum of squares over fixed-width chunks in order.

Slower than cuBLAS at most shapes (small batches use an eighth of a 64-row tile): the
mode trades speed for bits. `reference_matmul` and `reference_rms_norm` are the torch
computations they are tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import envs

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
NORM_BLOCK = 1024
"""Columns of a row each step of the norm's sum of squares adds (fixed: the order of a
row's reduction must not follow anything but its width)."""


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROW_EXACT: tl.constexpr,
):
    """y[M, N] = x[M, K] @ w[N, K]^T (+ bias): one output tile per program."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(w_cols + k[:, None], mask=(k[:, None] < K) & col_ok[None, :], other=0.0)
        if ROW_EXACT:  # see engine/kernels/triton_attention.py's _dot
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif DOT_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    stride_x,
    stride_y,
    K,
    eps,
    BLOCK: tl.constexpr,
    SCALE_IN_WEIGHT_DTYPE: tl.constexpr,
):
    """Row program_id(0): y = x / sqrt(mean(x^2) + eps) * w, x in float32."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + k, mask=k < K, other=0.0)
        if SCALE_IN_WEIGHT_DTYPE:
            # Rounded to the weight's dtype, then multiplied: in float32, exact for two
            # 16-bit floats, so the one rounding of the store is torch's own.
            y = (x * rstd).to(w.dtype).to(tl.float32) * w.to(tl.float32)
        else:
            y = x * rstd * w.to(tl.float32)
        tl.store(y_ptr + row * stride_y + k, y.to(y_ptr.dtype.element_ty), mask=k < K)


def _dot_f32(dtype: torch.dtype) -> bool:
    """float32 inputs sum in IEEE float32 (never TF32); under the interpreter always."""
    return dtype == torch.float32 or envs.triton_interpret()


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [M, K] @ weight[N, K]^T (+ bias) in x's dtype, each row's bits independent of M."""
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("matmul needs rows with contiguous columns")
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(cols, BLOCK_N))
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        rows, cols, depth, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_F32=_dot_f32(x.dtype), ROW_EXACT=envs.triton_interpret(), num_warps=4,
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 rows x [M, K], in the weight's dtype: as `TorchOps.norm` does it,
    normalized in float32 and, for a weight of another dtype, scaled in that dtype."""
    if x.stride(-1) != 1:
        raise ValueError("rms_norm needs rows with contiguous columns")
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=weight.dtype, device=x.device)
    if rows == 0:
        return out
    _rms_norm_kernel[(rows,)](
        x, weight, out, x.stride(0), out.stride(0), width, eps,
        BLOCK=min(NORM_BLOCK, triton.next_power_of_2(width)),
        SCALE_IN_WEIGHT_DTYPE=weight.dtype != x.dtype,
    )  # fmt: skip
    return out


def reference_matmul(x, weight, bias=None) -> torch.Tensor:
    """The product in float64, for the tests."""
    bias = None if bias is None else bias.double()
    return torch.nn.functional.linear(x.double(), weight.double(), bias)


def reference_rms_norm(x, weight, eps: float) -> torch.Tensor:
    """`TorchOps.norm`'s computation, for the tests."""
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, eps)
    if weight.dtype == x.dtype:
        return normed * weight
    return normed.to(weight.dtype) * weight
