"""Loading HF safetensors checkpoints into the fused layout our forward uses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.model_spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    """q, k and v projections stacked along the output dim: one matmul instead of three."""
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    """gate and up projections stacked: one matmul, split after."""
    down: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def _checkpoint_files(model_dir: Path) -> list[Path]:
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
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name] = handle.get_tensor(name)
    return tensors


def load_weights(
    model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype, device: str
) -> ModelWeights:
    state = read_state_dict(model_dir)

    def take(name: str) -> torch.Tensor:
        try:
            return state.pop(name).to(dtype=dtype, device=device)
        except KeyError:
            raise ModelLoadError(f"checkpoint {model_dir} lacks tensor {name}") from None

    layers = [_load_layer(take, i, spec, state) for i in range(spec.num_layers)]
    embed = take("model.embed_tokens.weight")
    if "lm_head.weight" in state and not spec.tie_word_embeddings:
        lm_head = take("lm_head.weight")
    else:
        lm_head = embed
    return ModelWeights(
        embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head
    )


def _load_layer(take, index: int, spec: ModelSpec, state: dict) -> LayerWeights:
    prefix = f"model.layers.{index}."
    attn = prefix + "self_attn."
    mlp = prefix + "mlp."
    qkv = torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]).contiguous()
    qkv_bias = None
    if spec.qkv_bias:
        qkv_bias = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]).contiguous()
    gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]).contiguous()
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight"),
        qkv=qkv,
        qkv_bias=qkv_bias,
        o_proj=take(attn + "o_proj.weight"),
        # Llama with attention_bias=True also has an o_proj bias; Qwen2 does not.
        o_bias=take(attn + "o_proj.bias") if attn + "o_proj.bias" in state else None,
        post_norm=take(prefix + "post_attention_layernorm.weight"),
        gate_up=gate_up,
        down=take(mlp + "down_proj.weight"),
    )
