"""Rotary position embeddings, with every rope_scaling type transformers knows.

The inverse frequencies come from transformers' own initialisers, so `rope_theta`,
`linear`, `llama3`, `yarn` and friends match the reference exactly; applying them
is our code (rotate-half layout, as in HF checkpoints).

A model whose layer types rotate differently (Gemma 3: local and global layers) has
one table per type (`layer_type`). LongRoPE (Phi-3) rotates with its short factors
while a sequence is within `original_max_position_embeddings` and with its long ones
after, and transformers decides per forward call: a prompt longer than the original
length is rotated long from its first token, a shorter one short until its tokens
pass that length. The table therefore has two halves: rows [0, n) for sequences whose
prompt fits (short below the original length, long from it on), rows [n, 2n) long
throughout, for the others; `row_offset` says which half a sequence reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _params(config: PretrainedConfig, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        return params.get(layer_type) or {}
    return params


def _rope_type(config: PretrainedConfig, layer_type: str | None = None) -> str:
    params = _params(config, layer_type)
    return params.get("rope_type", params.get("type", "default"))


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position (plus `row_offset`)."""

    def __init__(
        self,
        config: PretrainedConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
        layer_type: str | None = None,
    ):
        self.max_positions = max_positions
        self.long_prompt_from: int | None = None
        """LongRoPE: prompts longer than this read the all-long half of the table."""
        positions = torch.arange(max_positions, dtype=torch.float32)
        if _rope_type(config, layer_type) == "longrope":
            cos, sin = self._longrope_tables(config, positions, layer_type)
        else:
            inv_freq, scaling = _inv_freq(config, layer_type)
            cos, sin = _tables(positions, inv_freq, scaling)
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def _longrope_tables(self, config, positions, layer_type):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = _params(config, layer_type)
        original = params.get("original_max_position_embeddings")
        original = original or config.original_max_position_embeddings
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        init = ROPE_INIT_FUNCTIONS["longrope"]
        short = _tables(positions, *init(config, "cpu", **kwargs))
        long = _tables(positions, *init(config, "cpu", seq_len=original + 1, **kwargs))
        from_original = positions[:, None] >= original
        first_half = [
            torch.where(from_original, lg, sh) for sh, lg in zip(short, long, strict=True)
        ]
        self.long_prompt_from = int(original)
        return tuple(torch.cat([a, b]) for a, b in zip(first_half, long, strict=True))

    def row_offset(self, prompt_len: int) -> int:
        """Added to a sequence's positions to index this table: nonzero only for a
        LongRoPE prompt longer than the original context."""
        if self.long_prompt_from is not None and prompt_len > self.long_prompt_from:
            return self.max_positions
        return 0

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Rotate q [T, Hq, D] and k [T, Hkv, D] for tokens at table rows `positions` [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _tables(positions, inv_freq, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(positions, inv_freq.float())
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos() * scaling, angles.sin() * scaling


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _inv_freq(
    config: PretrainedConfig, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    rope_type = _rope_type(config, layer_type)
    if rope_type == "default":
        return _default_inv_freq(config, layer_type)
    # Only scaled ropes need transformers' initialisers (and its ~1 s import).
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        return _default_inv_freq(config, layer_type)
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)


def _default_inv_freq(
    config: PretrainedConfig, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    params = _params(config, layer_type)
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return inv_freq, 1.0
