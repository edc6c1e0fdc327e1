"""What the engine needs to know about a Llama-family checkpoint, read from config.json.

Two readers. A config.json that spells out every field the engine reads, with plain
rotary embeddings, is read as JSON: transformers' typed config classes import
torch.distributed.tensor and more, a second of every worker's (re)start. Anything
else (a rope_scaling type, a field left to its class default) goes through
transformers' AutoConfig, whose class defaults and rope normalisation are the truth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only Llama-family model; the KV layout derives from it."""

    model_id: str
    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    hf_config: Any
    """transformers' config object, or the plain JSON fields as attributes."""

    @property
    def context_window(self) -> int:
        """Longest sequence the forward supports exactly (sliding-window models are capped)."""
        window = getattr(self.hf_config, "sliding_window", None)
        uses_window = getattr(self.hf_config, "use_sliding_window", True)
        if window and uses_window:
            return min(self.max_position_embeddings, int(window))
        return self.max_position_embeddings


def load_model_spec(model_dir: str | Path, model_id: str | None = None) -> ModelSpec:
    """Read config.json of a local HF model directory; never touches the network."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json (expected a local HF model dir)")
    config = plain_config(json.loads((model_dir / "config.json").read_text()))
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return spec_from_hf_config(config, model_id or model_dir.name)


_PLAIN_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_WINDOW_FIELDS = {"mistral": ("sliding_window",), "qwen2": ("sliding_window", "use_sliding_window")}
"""Fields whose class defaults would cap the context window when left out."""


def plain_config(fields: dict) -> SimpleNamespace | None:
    """config.json's fields as attributes, when they alone determine the spec and the
    rotary tables; None when a transformers config class has to fill in or normalise."""
    family = _family(fields.get("architectures") or [], fields.get("model_type"))
    required = _PLAIN_FIELDS + _WINDOW_FIELDS.get(family or "", ())
    if family is None or any(name not in fields for name in required):
        return None
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    has_theta = "rope_theta" in rope or "rope_theta" in fields
    if rope_type != "default" or not has_theta or "partial_rotary_factor" in fields:
        return None
    return SimpleNamespace(**fields)


def _family(architectures: list[str], model_type: str | None) -> str | None:
    family = next(
        (SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None
    )
    if family is None and model_type in SUPPORTED_ARCHITECTURES.values():
        family = model_type
    return family


def spec_from_hf_config(config: Any, model_id: str) -> ModelSpec:
    architectures = getattr(config, "architectures", None) or []
    family = _family(architectures, getattr(config, "model_type", None))
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or getattr(config, 'model_type', None)!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelSpec(
        model_id=model_id,
        family=family,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        hf_config=config,
    )
