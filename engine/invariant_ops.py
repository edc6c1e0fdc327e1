"""Torch layer ops whose rows do not depend on their batch: the GPU path's deterministic mode.

`make_layer_ops` builds `InvariantTorchOps` instead of `TorchOps` for a model run with
`deterministic` where the native CPU kernels do not run it (CUDA; on a CPU, Triton's
interpreter). Projections (the LM head included) and RMSNorms run on the Triton kernels
of engine/kernels/triton_invariant.py, one tile shape and one reduction order for every
batch size; the embedding, RoPE, SiLU*mul and the residual adds are element-wise, the
same bits in any batch already. The kernel module is imported on first use, so the
engine imports without triton.
"""

from __future__ import annotations

import functools

import torch

from engine.layer_ops import Linear, TorchOps


def invariant_ops_run_on(device: str) -> str | None:
    """Why the batch-invariant torch ops cannot run on `device`, or None where they can
    (wherever the Triton kernels can: CUDA, or a CPU under TRITON_INTERPRET=1)."""
    from engine.triton_backend import triton_runs_on

    return triton_runs_on(device)


@functools.cache
def _kernels():
    from engine.kernels import triton_invariant

    return triton_invariant


class InvariantTorchOps(TorchOps):
    """`TorchOps` with batch-invariant projections and norms."""

    name = "torch"

    def norm(self, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _kernels().rms_norm(residual.contiguous(), weight, self.eps)

    def project(self, x: torch.Tensor, projection: Linear) -> torch.Tensor:
        return _kernels().matmul(x.contiguous(), projection.weight, projection.bias)
