"""Loading HF safetensors checkpoints into the fused layout our forward uses.

Projections load as `Linear(weight [out, in], bias)`; the model then hands each to
its layer ops' `prepare_linear` (`ModelWeights.prepare`), which may repack it (the
native CPU kernels do) so that only the prepared copy stays in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.layer_ops import Linear
from engine.model_spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    """q, k and v projections stacked along the output dim: one matmul instead of three."""
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    """gate and up projections stacked: one matmul, split after."""
    down: Linear

    def projections(self) -> dict[str, Linear]:
        return {"qkv": self.qkv, "o_proj": self.o_proj, "gate_up": self.gate_up, "down": self.down}


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
                setattr(layer, name, prepare_linear(projection))
        tied = self.embed is self.lm_head
        self.lm_head = prepare_linear(self.lm_head)
        if tied:
            self.embed = self.lm_head

    def nbytes_streamed(self) -> int:
        """Bytes a forward step reads in full: every projection, the norms, the LM head."""
        norms = sum(layer.input_norm.numel() + layer.post_norm.numel() for layer in self.layers)
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
    embed = Linear(take("model.embed_tokens.weight"))
    if "lm_head.weight" in state and not spec.tie_word_embeddings:
        lm_head = Linear(take("lm_head.weight"))
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
    # Llama with attention_bias=True also has an o_proj bias; Qwen2 does not.
    o_bias = take(attn + "o_proj.bias") if attn + "o_proj.bias" in state else None
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight"),
        qkv=Linear(qkv, qkv_bias),
        o_proj=Linear(take(attn + "o_proj.weight"), o_bias),
        post_norm=take(prefix + "post_attention_layernorm.weight"),
        gate_up=Linear(gate_up),
        down=Linear(take(mlp + "down_proj.weight")),
    )
