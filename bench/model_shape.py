"""The shapes of a Llama-family model that capacity and roofline arithmetic need.

`pdserve kv-calc` and `pdserve roofline` read a model here (`demo`, a local HF
directory, or a bare `config.json`, which is enough: no weights are opened), and
`bench/roofline.py` counts FLOPs and bytes from the resulting `ModelShape`. The
engine's own `ModelSpec` carries the same field names, so the roofline accepts either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
"""Bytes per element of each dtype the calculators know (fp8 for KV caches and weights)."""


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only transformer with grouped-query attention."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )


def layer_linear_params(model) -> int:
    """Weights of one layer's projections (q, k, v, o and the gated MLP): what a token multiplies."""
    h, hd = model.hidden_size, model.head_dim
    attention = 2 * h * model.num_heads * hd + 2 * h * model.num_kv_heads * hd
    return attention + 3 * h * model.intermediate_size


def lm_head_params(model) -> int:
    return model.hidden_size * model.vocab_size


def streamed_weight_params(model) -> int:
    """Weights a forward pass reads in full: every layer's projections, the norms, the LM head.

    The input embedding is a lookup (a few rows per step), so untied embeddings are not
    counted here; tied ones are read in full as the LM head.
    """
    norms = (2 * model.num_layers + 1) * model.hidden_size
    return model.num_layers * layer_linear_params(model) + norms + lm_head_params(model)


def total_params(model) -> int:
    """Every weight held in memory (the untied input embedding included)."""
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    return streamed_weight_params(model) + embedding


def shape_from_config(config: dict, name: str) -> ModelShape:
    """A HF `config.json` dict -> ModelShape (Llama, Mistral, Qwen2 key names)."""
    try:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            name=name,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ValueError(f"{name}: config has no {exc.args[0]!r}") from None


def load_shape(model: str | None = None, config_path: str | None = None) -> ModelShape:
    """Called by the kv-calc and roofline CLIs: `demo`, a model directory, or a config file."""
    if config_path:
        path = Path(config_path)
        return shape_from_config(json.loads(path.read_text()), path.stem)
    if model == "demo":
        from engine.demo_model import resolve_model

        directory, name = resolve_model(model)
    else:
        directory = Path(model or "").expanduser()
        name = directory.name
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--model {model!r} is neither 'demo' nor a directory with config.json")
    return shape_from_config(json.loads(config_file.read_text()), name)
