"""The shapes of a Llama-family model that capacity and roofline arithmetic need.

`pdserve kv-calc` and `pdserve roofline` read a model here (`demo`, a local HF
directory, or a bare `config.json`, which is enough: no weights are opened) with the
engine's own reader (engine/model_spec.py), so a config means the same here as in a
worker: its `ModelSpec`, whose shape fields (num_layers, hidden_size,
intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size,
tie_word_embeddings) `bench/roofline.py` counts FLOPs and bytes from.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from engine.errors import ModelLoadError
from engine.model_spec import ModelSpec, load_model_spec, spec_from_hf_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
"""Bytes per element of each dtype the calculators know (fp8 for KV caches and weights)."""
UNUSED_BY_SHAPES = {"rms_norm_eps": 1e-5, "max_position_embeddings": 0}
"""Fields the engine's reader takes that no shape arithmetic reads: a bare config given
to the calculators may leave them out."""


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


def shape_from_config(config: dict, name: str) -> ModelSpec:
    """A HF `config.json` dict -> the engine's `ModelSpec` (its key names and defaults)."""
    try:
        spec = spec_from_hf_config(SimpleNamespace(**{**UNUSED_BY_SHAPES, **config}), name)
    except AttributeError as exc:
        raise ValueError(f"{name}: config has no {exc.name!r}") from None
    except ModelLoadError as exc:
        raise ValueError(f"{name}: {exc}") from None
    _check(spec)
    return spec


def load_shape(model: str | None = None, config_path: str | None = None) -> ModelSpec:
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
    if not (directory / "config.json").is_file():
        raise ValueError(f"--model {model!r} is neither 'demo' nor a directory with config.json")
    try:
        spec = load_model_spec(directory, name)
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from None
    _check(spec)
    return spec


def _check(spec: ModelSpec) -> None:
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads"):
        if getattr(spec, field) <= 0:
            raise ValueError(f"{field} must be positive, got {getattr(spec, field)}")
    if spec.num_kv_heads <= 0 or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({spec.num_kv_heads}) must divide num_heads ({spec.num_heads})"
        )
