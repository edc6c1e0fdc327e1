"""The decoder-only architectures the engine serves, and how each differs from Llama.

Every served architecture is a Llama-shaped decoder (RMSNorm, rotary attention with
grouped KV heads, a gated MLP) plus a few traits, each as its transformers
implementation defines it:

    Qwen2           biases on q, k and v
    Qwen3           per-head RMSNorm of q and k before the rotation
    Gemma 2         norms of (1 + weight), also after attention and after the MLP;
                    embeddings scaled by sqrt(hidden); GELU (tanh); attention and
                    final-logit soft-capping; queries scaled by query_pre_attn_scalar;
                    sliding-window and global layers alternating
    Gemma 3 (text)  Gemma 2 without soft-capping, with per-head q/k norms and a rotary
                    table per layer type (local and global)
    Phi-3           q|k|v and gate|up fused in the checkpoint; LongRoPE scaling
    Mixtral         a mixture of experts instead of the MLP (softmax, top-k, renormalise)
    Qwen3-MoE       Qwen3 attention, experts with optional renormalisation

`load_model_spec` (engine/model_spec.py) reads a config into a `ModelSpec` from the
trait below; the forward (engine/model.py) and the weight loader (engine/weights.py)
act on the spec's fields, never on family names. Known architectures that are not
served are refused with what they lack (`UNSERVED`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """What one transformers `*ForCausalLM` class adds to the Llama decoder."""

    family: str
    qkv_bias: bool = False
    """Biases on q, k and v whatever config.attention_bias says (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and of k, before the rotation."""
    gemma_norms: bool = False
    """Norms scale by (1 + weight) and also follow the attention and the MLP outputs;
    embeddings are scaled by sqrt(hidden_size)."""
    fused_projections: bool = False
    """The checkpoint stores qkv_proj and gate_up_proj (Phi-3)."""
    experts: str | None = None
    """How the experts' tensors are named: 'mixtral' (block_sparse_moe, w1/w2/w3) or
    'qwen3_moe' (mlp, gate/up/down_proj); None: a dense MLP."""
    activation_key: str = "hidden_act"
    """The config field naming the MLP's activation."""
    layer_types: bool = False
    """config.layer_types says which layers use the sliding window (else all do when
    config.sliding_window is set)."""
    rope_per_layer_type: bool = False
    """config.rope_parameters holds one rotary setting per layer type (Gemma 3)."""


ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama"),
    "MistralForCausalLM": Architecture("mistral"),
    "Qwen2ForCausalLM": Architecture("qwen2", qkv_bias=True, layer_types=True),
    "Qwen3ForCausalLM": Architecture("qwen3", qk_norm=True, layer_types=True),
    "Gemma2ForCausalLM": Architecture(
        "gemma2", gemma_norms=True, activation_key="hidden_activation", layer_types=True
    ),
    "Gemma3ForCausalLM": Architecture(
        "gemma3",
        qk_norm=True,
        gemma_norms=True,
        activation_key="hidden_activation",
        layer_types=True,
        rope_per_layer_type=True,
    ),
    "Phi3ForCausalLM": Architecture("phi3", fused_projections=True),
    "MixtralForCausalLM": Architecture("mixtral", experts="mixtral"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", qk_norm=True, experts="qwen3_moe"),
}

MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""config.json's model_type -> the architecture, for configs that name none."""

UNSERVED = {
    "DeepseekV3ForCausalLM": (
        "multi-head latent attention (a compressed KV cache of kv_lora_rank + "
        "qk_rope_head_dim per token and layer, absorbed into the projections) and "
        "DeepSeek's routing (sigmoid scores, grouped top-k, shared experts, dense first "
        "layers) are not implemented"
    ),
    "DeepseekV2ForCausalLM": "multi-head latent attention is not implemented",
    "Gemma3ForConditionalGeneration": (
        "the vision tower and the multimodal wrapper are not implemented; the text-only "
        "Gemma3ForCausalLM is served"
    ),
    "GemmaForCausalLM": "Gemma 1 (GELU MLP with its own norms) is not implemented",
    "Phi3SmallForCausalLM": "Phi-3-small's blocksparse attention is not implemented",
    "PhiMoEForCausalLM": "PhiMoE's sparsemixer routing is not implemented",
    "Qwen2MoeForCausalLM": "Qwen2-MoE's shared expert is not implemented",
}
"""Architectures people ask for that are not served, with what is missing."""

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""config activation names the forward implements -> the forward's names."""


def architecture_of(architectures: list[str], model_type: str | None) -> Architecture | None:
    """The served architecture a config names (by class, else by model_type), or None."""
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not architectures and model_type in MODEL_TYPES:
        return ARCHITECTURES[MODEL_TYPES[model_type]]
    return None


def architecture_name(family: str) -> str:
    """The transformers class of a served family (`Architecture.family`)."""
    return next(name for name, arch in ARCHITECTURES.items() if arch.family == family)
