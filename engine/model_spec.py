"""What the engine needs to know about a Llama-family checkpoint, read from config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

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
    hf_config: PretrainedConfig

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
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return spec_from_hf_config(config, model_id or model_dir.name)


def spec_from_hf_config(config: PretrainedConfig, model_id: str) -> ModelSpec:
    architectures = getattr(config, "architectures", None) or []
    family = next(
        (SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None
    )
    if family is None:
        family = (
            config.model_type if config.model_type in SUPPORTED_ARCHITECTURES.values() else None
        )
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or config.model_type!r}; "
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
