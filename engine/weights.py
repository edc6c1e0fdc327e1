"""Loading HF safetensors checkpoints into the fused layout our forward uses.

Projections load as `Linear(weight [out, in], bias)`; the model then hands each to
its layer ops' `prepare_linear` (`ModelWeights.prepare`), which may repack it (the
native CPU kernels do) so that only the prepared copy stays in memory.

Every tensor of the checkpoint must be used and every tensor the architecture needs
must be there: a missing one, a leftover one (quantization scales, a part of the model
this engine does not implement) or an LM head that is neither stored nor tied is a
start-up error naming it, never a silent substitute.

Gemma's norms scale by (1 + weight): the 1 is added here, once, in float32, so that
every norm runs as a plain RMSNorm (the native kernels' prologue included).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.layer_ops import Linear
from engine.model_spec import ModelSpec

IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Buffers some older checkpoints saved that the forward recomputes."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    """q, k and v projections stacked along the output dim: one matmul instead of three."""
    o_proj: Linear
    post_norm: torch.Tensor
    """The norm before the MLP (Llama's post_attention_layernorm, Gemma's
    pre_feedforward_layernorm)."""
    gate_up: Linear | None = None
    """gate and up projections stacked: one matmul, split after. None in a MoE layer."""
    down: Linear | None = None
    q_norm: torch.Tensor | None = None
    """Per-head RMSNorm weights [head_dim] of q and k (Qwen3, Gemma 3)."""
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    """Gemma: the norm of the attention's output before the residual add."""
    mlp_out_norm: torch.Tensor | None = None
    """Gemma: the norm of the MLP's output before the residual add."""
    router: Linear | None = None
    """MoE: router logits [num_experts, hidden]."""
    experts_gate_up: list[Linear] = field(default_factory=list)
    """MoE: each expert's [gate; up] [2 * I, hidden]. A tensor-parallel rank would take
    rows [r * I / tp, (r + 1) * I / tp) of each half (the weight viewed as [2, I, hidden])
    and the same columns of its `experts_down` [hidden, I]."""
    experts_down: list[Linear] = field(default_factory=list)

    def projections(self) -> dict[str, Linear]:
        """Every projection by name (`experts_gate_up.3` for an expert's)."""
        named = {}
        for name in ("qkv", "o_proj", "gate_up", "down", "router"):
            if getattr(self, name) is not None:
                named[name] = getattr(self, name)
        for name in ("experts_gate_up", "experts_down"):
            named.update({f"{name}.{i}": p for i, p in enumerate(getattr(self, name))})
        return named

    def set_projection(self, name: str, projection) -> None:
        base, _, index = name.partition(".")
        if index:
            getattr(self, base)[int(index)] = projection
        else:
            setattr(self, base, projection)

    def norms(self) -> dict[str, torch.Tensor]:
        """Every norm weight by name."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name.endswith("norm") and getattr(self, f.name) is not None
        }


@dataclass
class ModelWeights:
    embed: Linear
    """The input embedding table (its `weight`); the same object as `lm_head` when tied."""
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear

    def prepare(self, prepare_linear) -> None:
        """Replace every projection by `prepare_linear(projection)` (e.g. packed for the
        native kernels), in place, one at a time so that peak memory stays near one copy.
        A tied embedding stays the same object as the prepared LM head."""
        for layer in self.layers:
            for name, projection in layer.projections().items():
                layer.set_projection(name, prepare_linear(projection))
        tied = self.embed is self.lm_head
        self.lm_head = prepare_linear(self.lm_head)
        if tied:
            self.embed = self.lm_head

    def nbytes_streamed(self) -> int:
        """Bytes a forward step reads in full: every projection, the norms, the LM head
        (every expert counted, though a step reads only the routed ones)."""
        norms = sum(n.numel() for layer in self.layers for n in layer.norms().values())
        norms = (norms + self.final_norm.numel()) * self.final_norm.element_size()
        projections = sum(p.nbytes for layer in self.layers for p in layer.projections().values())
        return projections + self.lm_head.nbytes + norms


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shard_names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {model_dir}")
    return files


def read_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name] = handle.get_tensor(name)
    return tensors


class _Taker:
    """Pops tensors out of the state dict, converted; names what is missing."""

    def __init__(self, state: dict, spec: ModelSpec, dtype, device, model_dir):
        self.state, self.spec, self.dtype, self.device = state, spec, dtype, device
        self.model_dir = model_dir

    def __call__(self, name: str) -> torch.Tensor:
        try:
            tensor = self.state.pop(name)
        except KeyError:
            raise ModelLoadError(
                f"checkpoint {self.model_dir} lacks tensor {name}, which "
                f"{self.spec.architecture} needs{_quantized_hint(self.state)}"
            ) from None
        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ModelLoadError(
                f"checkpoint tensor {name} is {tensor.dtype}: only float32/float16/bfloat16 "
                "weights are implemented (quantized weights would need their scales)"
            )
        return tensor.to(dtype=self.dtype, device=self.device)

    def norm(self, name: str) -> torch.Tensor:
        """A norm's weight; Gemma's as the float32 (1 + weight) its norms multiply by
        (rounding 1 + w to bf16 would lose most of w's bits)."""
        if not self.spec.gemma_norms:
            return self(name)
        return (self(name).float() + 1.0) if self.dtype != torch.float32 else self(name) + 1.0

    def has(self, name: str) -> bool:
        return name in self.state


def load_weights(
    model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype, device: str
) -> ModelWeights:
    state = read_state_dict(model_dir)
    take = _Taker(state, spec, dtype, device, model_dir)
    layers = [_load_layer(take, i, spec) for i in range(spec.num_layers)]
    embed = Linear(take("model.embed_tokens.weight"))
    lm_head = _lm_head(take, spec, embed, model_dir)
    weights = ModelWeights(
        embed=embed, layers=layers, final_norm=take.norm("model.norm.weight"), lm_head=lm_head
    )
    leftover = sorted(name for name in state if not IGNORED_TENSORS.search(name))
    if leftover:
        raise ModelLoadError(
            f"checkpoint {model_dir} has {len(leftover)} tensors {spec.architecture} does not "
            f"use, e.g. {leftover[:6]}{_quantized_hint(state)}: serving it without them "
            "would not be the model they belong to"
        )
    return weights


def _lm_head(take: _Taker, spec: ModelSpec, embed: Linear, model_dir) -> Linear:
    if spec.tie_word_embeddings:
        if take.has("lm_head.weight"):
            take("lm_head.weight")  # a saved copy of the tied table
        return embed
    if not take.has("lm_head.weight"):
        raise ModelLoadError(
            f"checkpoint {model_dir} has no lm_head.weight and config.json does not set "
            "tie_word_embeddings: the output projection is missing (using the input "
            "embedding instead would be another model)"
        )
    return Linear(take("lm_head.weight"))


def _quantized_hint(state: dict) -> str:
    markers = ("qweight", "qzeros", "scales", "weight_scale", "scale_inv", "g_idx")
    if any(name.rsplit(".", 1)[-1] in markers for name in state):
        return " (the checkpoint holds quantized tensors: not implemented)"
    return ""


def _load_layer(take: _Taker, index: int, spec: ModelSpec) -> LayerWeights:
    prefix = f"model.layers.{index}."
    attn = prefix + "self_attn."
    if spec.fused_projections:
        qkv = Linear(take(attn + "qkv_proj.weight"))
    else:
        qkv_weight = torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]).contiguous()
        qkv_bias = None
        if spec.qkv_bias:
            qkv_bias = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]).contiguous()
        qkv = Linear(qkv_weight, qkv_bias)
    o_bias = take(attn + "o_proj.bias") if spec.o_bias else None
    layer = LayerWeights(
        input_norm=take.norm(prefix + "input_layernorm.weight"),
        qkv=qkv,
        o_proj=Linear(take(attn + "o_proj.weight"), o_bias),
        post_norm=take.norm(
            prefix
            + ("pre_feedforward_layernorm" if spec.gemma_norms else "post_attention_layernorm")
            + ".weight"
        ),
    )
    if spec.qk_norm:
        layer.q_norm = take.norm(attn + "q_norm.weight")
        layer.k_norm = take.norm(attn + "k_norm.weight")
    if spec.gemma_norms:
        layer.attn_out_norm = take.norm(prefix + "post_attention_layernorm.weight")
        layer.mlp_out_norm = take.norm(prefix + "post_feedforward_layernorm.weight")
    if spec.experts is not None and spec.experts.sparse_layers[index]:
        _load_experts(take, prefix, spec, layer)
    else:
        _load_dense_mlp(take, prefix + "mlp.", spec, layer)
    return layer


def _load_dense_mlp(take: _Taker, mlp: str, spec: ModelSpec, layer: LayerWeights) -> None:
    if spec.fused_projections:
        layer.gate_up = Linear(take(mlp + "gate_up_proj.weight"))
    else:
        gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
        layer.gate_up = Linear(gate_up.contiguous())
    layer.down = Linear(take(mlp + "down_proj.weight"))


_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
}
"""Where each family's checkpoints keep the router ('gate') and each expert's gate, up
and down projections."""


def _load_experts(take: _Taker, prefix: str, spec: ModelSpec, layer: LayerWeights) -> None:
    family = "mixtral" if spec.family == "mixtral" else "qwen3_moe"
    block, (gate, up, down) = _EXPERT_NAMES[family]
    layer.router = Linear(take(prefix + block + "gate.weight"))
    experts = prefix + block + "experts."
    if take.has(experts + "gate_up_proj"):
        # Stacked as transformers 5 holds them in memory: [E, 2I, H] and [E, H, I].
        stacked_gate_up, stacked_down = take(experts + "gate_up_proj"), take(experts + "down_proj")
        layer.experts_gate_up = [Linear(w.contiguous()) for w in stacked_gate_up]
        layer.experts_down = [Linear(w.contiguous()) for w in stacked_down]
        return
    for e in range(spec.experts.num_experts):
        weights = [take(f"{experts}{e}.{name}.weight") for name in (gate, up, down)]
        layer.experts_gate_up.append(Linear(torch.cat(weights[:2]).contiguous()))
        layer.experts_down.append(Linear(weights[2]))
