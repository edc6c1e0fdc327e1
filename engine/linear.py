"""The projection used by every layer: y = x @ W^T (+ b), picked per batch shape.

On CPU, BLAS sgemm is 1.5-3x slower for a short, wide activation (x of a few rows)
as the left operand than for the same product computed as (W @ x^T)^T. Decode batches
are exactly that shape, so small float32 batches take the transposed route;
prefill-sized batches keep F.linear.
bf16 goes to oneDNN (AMX where the CPU has it), where F.linear is as fast or faster at
every decode batch size we measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SMALL_BATCH_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[0] > SMALL_BATCH_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t()
    if bias is not None:
        out = out + bias
    return out.contiguous()
