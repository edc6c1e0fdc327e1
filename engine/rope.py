"""Rotary position embeddings, with every rope_scaling type transformers knows.

The inverse frequencies come from transformers' own initialisers, so `rope_theta`,
`linear`, `llama3`, `yarn` and friends match the reference exactly; applying them
is our code (rotate-half layout, as in HF checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _rope_type(config: PretrainedConfig) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(
        self, config: PretrainedConfig, max_positions: int, dtype: torch.dtype, device: str
    ):
        inv_freq, scaling = _inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = (angles.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (angles.sin() * scaling).to(dtype=dtype, device=device)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Rotate q [T, Hq, D] and k [T, Hkv, D] for tokens at `positions` [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    rope_type = _rope_type(config)
    if rope_type == "default":
        return _default_inv_freq(config)
    # Only scaled ropes need transformers' initialisers (and its ~1 s import).
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        return _default_inv_freq(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


def _default_inv_freq(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return inv_freq, 1.0
