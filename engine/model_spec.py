"""What the engine needs to know about a checkpoint, read from config.json.

Two readers. A Llama, Mistral or Qwen2 config.json that spells out every field the
engine reads, with plain rotary embeddings, is read as JSON: transformers' typed
config classes import torch.distributed.tensor and more, a second of every worker's
(re)start. Anything else (another family, a rope_scaling type, a field left to its
class default) goes through transformers' AutoConfig, whose class defaults and
normalisation (rope parameters, layer types) are the truth.

A config the engine cannot serve exactly is refused here, at start-up, with what it
names and why (`ModelLoadError`): an architecture that is not served, a quantized
checkpoint, MLP biases, an activation or rotary variant the forward lacks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.architectures import (
    ACTIVATIONS,
    ARCHITECTURES,
    UNSERVED,
    Architecture,
    architecture_name,
    architecture_of,
)
from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {name: arch.family for name, arch in ARCHITECTURES.items()}


@dataclass(frozen=True)
class ExpertsSpec:
    """A mixture-of-experts MLP: each token goes to `top_k` of `num_experts` gated MLPs,
    weighted by the router's softmax over all experts (renormalised over the chosen
    ones when `renormalize`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    """Per layer: True where the MLP is the mixture (Qwen3-MoE may keep dense layers)."""

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"top-{self.top_k} of {self.num_experts} experts")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and traits of a served decoder-only model; the KV layout derives from it."""

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
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: its sliding window (a query at p sees keys in (p - window, p]), or
    None for full attention. Empty: every layer full."""
    qk_norm: bool = False
    gemma_norms: bool = False
    """Norms of (1 + weight), norms after attention and MLP, scaled embeddings."""
    fused_projections: bool = False
    activation: str = "silu"
    """The gated MLP's activation: 'silu' or 'gelu_tanh'."""
    attn_softcap: float | None = None
    """Attention scores become cap * tanh(score / cap) before the softmax (Gemma 2)."""
    final_softcap: float | None = None
    """The same on the final logits."""
    query_scale: float | None = None
    """Scale of q.k (None: head_dim ** -0.5)."""
    experts: ExpertsSpec | None = None
    o_bias: bool = False
    """o_proj has a bias (Llama with attention_bias)."""
    layer_rope_types: tuple[str, ...] = ()
    """Per layer: the key into config.rope_parameters of its rotary setting (Gemma 3);
    empty: one setting for every layer."""

    @property
    def architecture(self) -> str:
        return architecture_name(self.family)

    @property
    def context_window(self) -> int:
        """Longest sequence the forward supports exactly: sliding windows are served."""
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def windows_within(self, max_len: int) -> tuple[int | None, ...]:
        """Per layer: its window, None where it is full or where the window covers
        every sequence of at most `max_len` tokens (then it changes nothing)."""
        windows = self.layer_windows or (None,) * self.num_layers
        return tuple(w if w is not None and w < max_len else None for w in windows)

    def kv_window(self, max_len: int) -> int | None:
        """The window of every layer when all of them slide (then KV blocks before the
        widest window are dead), else None: some layer reads the whole sequence."""
        windows = self.windows_within(max_len)
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, w in enumerate(self.layer_windows) if w is not None)

    @property
    def sliding_window(self) -> int | None:
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None


def load_model_spec(model_dir: str | Path, model_id: str | None = None) -> ModelSpec:
    """Read config.json of a local HF model directory; never touches the network."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json (expected a local HF model dir)")
    fields = json.loads((model_dir / "config.json").read_text())
    refuse_unserved(fields)
    config = plain_config(fields)
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
_PLAIN_FAMILIES = {"llama": (), "mistral": ("sliding_window",), "qwen2": ("use_sliding_window",)}
"""Families whose JSON is read as is, with the fields whose class defaults matter."""


def plain_config(fields: dict) -> SimpleNamespace | None:
    """config.json's fields as attributes, when they alone determine the spec and the
    rotary tables; None when a transformers config class has to fill in or normalise."""
    arch = architecture_of(fields.get("architectures") or [], fields.get("model_type"))
    if arch is None or arch.family not in _PLAIN_FAMILIES:
        return None
    required = _PLAIN_FIELDS + _PLAIN_FAMILIES[arch.family]
    if any(name not in fields for name in required):
        return None
    if arch.family == "qwen2" and fields["use_sliding_window"] and "layer_types" not in fields:
        return None  # which layers slide comes from max_window_layers: Qwen2Config decides
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    has_theta = "rope_theta" in rope or "rope_theta" in fields
    if rope_type != "default" or not has_theta or "partial_rotary_factor" in fields:
        return None
    return SimpleNamespace(**fields)


def refuse_unserved(fields: dict) -> None:
    """Raise ModelLoadError for a config this engine cannot serve exactly, naming what
    and why. Called on config.json's raw fields before any config class is built."""
    architectures = fields.get("architectures") or []
    arch = architecture_of(architectures, fields.get("model_type"))
    if arch is None:
        named = architectures or [fields.get("model_type")]
        reasons = [f"{name}: {UNSERVED[name]}" for name in named if name in UNSERVED]
        why = "; ".join(reasons) or "it is not implemented"
        raise ModelLoadError(
            f"unsupported architecture {named!r}: {why}. Served: {sorted(ARCHITECTURES)}"
        )
    quantization = fields.get("quantization_config")
    if quantization:
        method = (
            quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else "?"
        )
        raise ModelLoadError(
            f"the checkpoint is quantized (quantization_config.quant_method={method!r}); the "
            "engine implements no quantized weights: loaded as plain tensors they would be "
            "cast without their scales (fp8) or be missing (AWQ/GPTQ pack them as qweight). "
            "Serve an unquantized bf16/fp16/fp32 checkpoint"
        )
    if fields.get("mlp_bias"):
        raise ModelLoadError(
            "config.json sets mlp_bias=true: biases on the MLP projections are not "
            "implemented, and ignoring them would change every output"
        )


def spec_from_hf_config(config: Any, model_id: str) -> ModelSpec:
    architectures = getattr(config, "architectures", None) or []
    arch = architecture_of(architectures, getattr(config, "model_type", None))
    if arch is None:
        model_type = getattr(config, "model_type", None)
        refuse_unserved({"architectures": architectures, "model_type": model_type})
    _refuse_variants(config, arch)
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        model_id=model_id,
        family=arch.family,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=arch.qkv_bias or attention_bias,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        hf_config=config,
        layer_windows=_layer_windows(config, arch),
        qk_norm=arch.qk_norm,
        gemma_norms=arch.gemma_norms,
        fused_projections=arch.fused_projections,
        activation=ACTIVATIONS[getattr(config, arch.activation_key, None) or "silu"],
        attn_softcap=_cap(getattr(config, "attn_logit_softcapping", None)),
        final_softcap=_cap(getattr(config, "final_logit_softcapping", None)),
        query_scale=_query_scale(config),
        experts=_experts(config, arch),
        o_bias=attention_bias and arch.family != "qwen2",
        layer_rope_types=tuple(config.layer_types) if arch.rope_per_layer_type else (),
    )


def _refuse_variants(config: Any, arch: Architecture) -> None:
    """Refuse what a served architecture's config may switch on that the forward lacks."""
    activation = getattr(config, arch.activation_key, None) or "silu"
    if activation not in ACTIVATIONS:
        raise ModelLoadError(
            f"{arch.family}: {arch.activation_key}={activation!r} is not implemented "
            f"(only {sorted(ACTIVATIONS)})"
        )
    if getattr(config, "mlp_bias", False):
        refuse_unserved({"architectures": [architecture_name(arch.family)], "mlp_bias": True})
    if getattr(config, "quantization_config", None):
        quantization = config.quantization_config
        as_dict = quantization if isinstance(quantization, dict) else vars(quantization)
        refuse_unserved(
            {"architectures": [architecture_name(arch.family)], "quantization_config": as_dict}
        )
    for params in _rope_settings(config):
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if factor not in (None, 1.0):
            raise ModelLoadError(
                f"{arch.family}: partial rotary embeddings (partial_rotary_factor={factor}) "
                "are not implemented"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError(f"{arch.family}: bidirectional attention is not implemented")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 2:
        raise ModelLoadError(f"{arch.family}: an odd head_dim ({head_dim}) cannot be rotated")


def _rope_settings(config: Any) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    nested = [v for v in params.values() if isinstance(v, dict)]
    return nested or [params]


def _layer_windows(config: Any, arch: Architecture) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers' attention layers read it."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (None,) * config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) if arch.layer_types else None
    if layer_types is None:
        return (int(window),) * config.num_hidden_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _cap(value) -> float | None:
    return float(value) if value else None


def _query_scale(config: Any) -> float | None:
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return None if scalar is None else 1.0 / math.sqrt(scalar)


def _experts(config: Any, arch: Architecture) -> ExpertsSpec | None:
    if arch.experts is None:
        return None
    layers = config.num_hidden_layers
    count = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if arch.experts == "mixtral":
        return ExpertsSpec(
            num_experts=count,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            sparse_layers=(True,) * layers,
        )
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return ExpertsSpec(
        num_experts=count,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )
