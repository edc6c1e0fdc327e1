"""The shapes of a decoder-only model that capacity and roofline arithmetic need.

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
    """Dimensions of a decoder-only transformer with grouped-query attention, and what
    changes its arithmetic: experts, sliding windows, a latent KV (MLA), extra norms."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: its sliding window, None where it attends to everything (empty: all)."""
    num_experts: int = 0
    """Routed experts of a mixture-of-experts layer (0: dense MLPs)."""
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    moe_layers: int = 0
    """Layers whose MLP is the mixture (the others are dense, `intermediate_size`)."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek)."""
    kv_latent_dim: int = 0
    """Multi-head latent attention: the per-token, per-layer latent cached instead of K
    and V (kv_lora_rank + qk_rope_head_dim); 0: plain K and V."""
    attention_params: int = 0
    """Weights of one layer's attention when they are not q, k, v and o of the head
    shapes (MLA's low-rank projections); 0: computed from the shapes."""
    norms_per_layer: int = 2
    """Hidden-size norms per layer (Gemma: 4); q/k norms count apart."""
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )


def experts_of(model) -> tuple[int, int, int, int, int]:
    """(routed experts, routed per token, expert intermediate size, MoE layers, shared
    experts) of a ModelShape or the engine's ModelSpec; zeros for a dense model."""
    spec_experts = getattr(model, "experts", None)
    if spec_experts is not None:
        return (
            spec_experts.num_experts,
            spec_experts.top_k,
            spec_experts.intermediate_size,
            sum(spec_experts.sparse_layers),
            0,
        )
    return (
        getattr(model, "num_experts", 0),
        getattr(model, "experts_per_token", 0),
        getattr(model, "expert_intermediate_size", 0),
        getattr(model, "moe_layers", 0),
        getattr(model, "shared_experts", 0),
    )


def attention_layer_params(model) -> int:
    """Weights of one layer's attention projections."""
    explicit = getattr(model, "attention_params", 0)
    if explicit:
        return explicit
    h, hd = model.hidden_size, model.head_dim
    return 2 * h * model.num_heads * hd + 2 * h * model.num_kv_heads * hd


def layer_linear_params(model) -> int:
    """Weights of one dense layer's projections (q, k, v, o and the gated MLP): what a
    token multiplies in a layer without experts."""
    return attention_layer_params(model) + 3 * model.hidden_size * model.intermediate_size


def mlp_params(model, experts_read: int | None = None) -> int:
    """Weights of every layer's MLP; in a mixture layer the router, the shared experts
    and `experts_read` routed experts (None: all of them)."""
    count, _, expert_size, moe_layers, shared = experts_of(model)
    h = model.hidden_size
    dense = (model.num_layers - moe_layers) * 3 * h * model.intermediate_size
    read = count if experts_read is None else min(count, experts_read)
    per_moe_layer = h * count + (read + shared) * 3 * h * expert_size
    return dense + moe_layers * per_moe_layer


def active_linear_params(model) -> int:
    """Weights one token multiplies in all layers: attention, dense MLPs, and in each
    mixture layer the router, the shared experts and its routed ones."""
    per_token = experts_of(model)[1]
    return model.num_layers * attention_layer_params(model) + mlp_params(model, per_token)


def lm_head_params(model) -> int:
    return model.hidden_size * model.vocab_size


def norm_params(model) -> int:
    default = 4 if getattr(model, "gemma_norms", False) else 2  # the engine's ModelSpec
    per_layer = getattr(model, "norms_per_layer", default) * model.hidden_size
    if getattr(model, "qk_norm", False):
        per_layer += 2 * model.head_dim
    return model.num_layers * per_layer + model.hidden_size


def streamed_weight_params(model, tokens: int | None = None) -> int:
    """Weights a forward pass over `tokens` tokens reads in full: every layer's
    projections, the norms, the LM head; of a mixture, at most `tokens` x experts per
    token routed experts per layer (None: all of them).

    The input embedding is a lookup (a few rows per step), so untied embeddings are not
    counted here; tied ones are read in full as the LM head.
    """
    read = None if tokens is None else tokens * experts_of(model)[1]
    attention = model.num_layers * attention_layer_params(model)
    return attention + mlp_params(model, read) + norm_params(model) + lm_head_params(model)


def total_params(model) -> int:
    """Every weight held in memory (the untied input embedding included)."""
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    return streamed_weight_params(model) + embedding


def all_layers_slide(model) -> int | None:
    """The widest window when every layer slides (the engine then frees the KV blocks
    behind it), else None."""
    windows = getattr(model, "layer_windows", ()) or ()
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def shape_from_config(config: dict, name: str) -> ModelShape:
    """A HF `config.json` dict -> ModelShape (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3,
    Mixtral, Qwen3-MoE and DeepSeek-V3 key names)."""
    try:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        model_type = config.get("model_type", "")
        return ModelShape(
            name=name,
            num_layers=layers,
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            layer_windows=_layer_windows(config, model_type, layers),
            norms_per_layer=4 if model_type.startswith("gemma") else 2,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            **_experts(config, model_type, layers),
            **_latent_attention(config, hidden, num_heads),
        )
    except KeyError as exc:
        raise ValueError(f"{name}: config has no {exc.args[0]!r}") from None


def _layer_windows(config: dict, model_type: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's window as transformers' config classes fill in `layer_types`."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return ()
    types = config.get("layer_types")
    if types is None:
        if model_type == "gemma2":
            types = ["sliding" if (i + 1) % 2 else "full" for i in range(layers)]
        elif model_type in ("gemma3", "gemma3_text"):
            pattern = config.get("sliding_window_pattern", 6)
            types = ["sliding" if (i + 1) % pattern else "full" for i in range(layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = config.get("max_window_layers", 28)
            types = ["sliding" if i >= first else "full" for i in range(layers)]
        else:  # Mistral, Mixtral, Phi-3, Qwen3-MoE: every layer
            types = ["sliding"] * layers
    return tuple(int(window) if t.startswith("sliding") else None for t in types)


def _experts(config: dict, model_type: str, layers: int) -> dict:
    count = config.get("num_local_experts") or config.get("num_experts")
    count = count or config.get("n_routed_experts") or 0
    if not count:
        return {}
    expert_size = config.get("moe_intermediate_size") or config["intermediate_size"]
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    first_dense = config.get("first_k_dense_replace") or 0
    moe_layers = sum(
        1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense
    )
    return dict(
        num_experts=int(count),
        experts_per_token=int(config["num_experts_per_tok"]),
        expert_intermediate_size=int(expert_size),
        moe_layers=moe_layers,
        shared_experts=int(config.get("n_shared_experts") or 0),
    )


def _latent_attention(config: dict, hidden: int, num_heads: int) -> dict:
    """DeepSeek's multi-head latent attention: the cache holds kv_lora_rank +
    qk_rope_head_dim per token and layer; its projections are low-rank."""
    rank = config.get("kv_lora_rank")
    if not rank:
        return {}
    rope, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    value, q_rank = config["v_head_dim"], config.get("q_lora_rank")
    q_params = hidden * num_heads * (nope + rope)
    if q_rank:
        q_params = hidden * q_rank + q_rank * num_heads * (nope + rope) + q_rank
    params = (
        q_params
        + hidden * (rank + rope)
        + rank
        + rank * num_heads * (nope + value)
        + num_heads * value * hidden
    )
    return dict(kv_latent_dim=rank + rope, attention_params=params)


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
