"""Loading HF safetensors checkpoints into the fused layout our forward uses.

Projections load as `Linear(weight [out, in], bias)`; the model then hands each to
its layer ops' `prepare_linear` (`ModelWeights.prepare`), which may repack it (the
native CPU kernels do) so that only the prepared copy stays in memory.

Tensors are read from the checkpoint as they are needed (engine/checkpoint.py). A
tensor-parallel rank (`shard`) reads only its part of each: the rows of its heads of
q, k and v and of its slice of gate and up, the columns of the same of o and down, its
rows of the vocabulary; norms and a mixture's router whole. A row-parallel bias is
rank 0's only (it is added once, before the partial sums meet).

Every tensor of the checkpoint must be used and every tensor the architecture needs
must be there: a missing one, a leftover one (quantization scales, a part of the model
this engine does not implement) or an LM head that is neither stored nor tied is a
start-up error naming it, never a silent substitute.

Gemma's norms scale by (1 + weight): the 1 is added here, once, in float32, so that
every norm runs as a plain RMSNorm (the native kernels' prologue included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint, Index, checkpoint_files
from engine.errors import ModelLoadError
from engine.layer_ops import Linear
from engine.model_spec import ModelSpec
from engine.parallel.shard import ModelShard

__all__ = ["LayerWeights", "ModelWeights", "checkpoint_files", "load_weights"]

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


class _Taker:
    """Reads tensors out of the checkpoint, converted, as this rank's shard takes them;
    names what is missing."""

    def __init__(self, checkpoint: Checkpoint, spec: ModelSpec, dtype, device, shard: ModelShard):
        self.checkpoint, self.spec, self.dtype, self.device = checkpoint, spec, dtype, device
        self.shard = shard

    def __call__(self, name: str, *indexes: Index, dim: int = 0) -> torch.Tensor:
        """The tensor `name` whole, or the parts `indexes` of it, concatenated along `dim`."""
        try:
            tensor = self.checkpoint.read_parts(name, list(indexes) or [()], dim)
        except KeyError:
            raise ModelLoadError(
                f"checkpoint {self.checkpoint.model_dir} lacks tensor {name}, which "
                f"{self.spec.architecture} needs{_quantized_hint(self.checkpoint.unused)}"
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
        return name in self.checkpoint

    # --- this rank's parts (everything, on a single rank) --------------------------

    def rows(self, name: str, *spans: slice) -> torch.Tensor:
        """Rows `spans` of a column-parallel weight (or its bias), concatenated."""
        if self.shard.whole:
            return self(name)
        return self(name, *((span,) for span in spans))

    def columns(self, name: str, span: slice) -> torch.Tensor:
        """Columns `span` of a row-parallel weight."""
        return self(name) if self.shard.whole else self(name, (slice(None), span))

    def vocab_rows(self, name: str) -> torch.Tensor:
        """This rank's rows of the embedding or the LM head, padded with zero rows to
        the same count on every rank."""
        if self.shard.whole:
            return self(name)
        vocab = self.shard.vocab
        table = self(name, (slice(vocab.real.start, vocab.real.stop),))
        missing = vocab.per_rank - vocab.real.count
        if missing:
            table = torch.cat([table, table.new_zeros(missing, table.shape[1])])
        return table


def load_weights(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: str,
    shard: ModelShard | None = None,
) -> ModelWeights:
    """The model's weights (this rank's `shard` of them; None: all), read from the
    checkpoint's files as they are needed."""
    shard = shard or ModelShard.of(spec)
    with Checkpoint(model_dir) as checkpoint:
        take = _Taker(checkpoint, spec, dtype, device, shard)
        layers = [_load_layer(take, i, spec) for i in range(spec.num_layers)]
        embed = Linear(take.vocab_rows("model.embed_tokens.weight"))
        lm_head = _lm_head(take, spec, embed, model_dir)
        weights = ModelWeights(
            embed=embed, layers=layers, final_norm=take.norm("model.norm.weight"), lm_head=lm_head
        )
        leftover = sorted(name for name in checkpoint.unused if not IGNORED_TENSORS.search(name))
        if leftover:
            raise ModelLoadError(
                f"checkpoint {model_dir} has {len(leftover)} tensors {spec.architecture} does "
                f"not use, e.g. {leftover[:6]}{_quantized_hint(checkpoint.unused)}: serving it "
                "without them would not be the model they belong to"
            )
    return weights


def _lm_head(take: _Taker, spec: ModelSpec, embed: Linear, model_dir) -> Linear:
    if spec.tie_word_embeddings:
        if take.has("lm_head.weight"):
            take.checkpoint.unused.discard("lm_head.weight")  # a saved copy of the tied table
        return embed
    if not take.has("lm_head.weight"):
        raise ModelLoadError(
            f"checkpoint {model_dir} has no lm_head.weight and config.json does not set "
            "tie_word_embeddings: the output projection is missing (using the input "
            "embedding instead would be another model)"
        )
    return Linear(take.vocab_rows("lm_head.weight"))


def _quantized_hint(names) -> str:
    markers = ("qweight", "qzeros", "scales", "weight_scale", "scale_inv", "g_idx")
    if any(name.rsplit(".", 1)[-1] in markers for name in names):
        return " (the checkpoint holds quantized tensors: not implemented)"
    return ""


def _load_layer(take: _Taker, index: int, spec: ModelSpec) -> LayerWeights:
    prefix = f"model.layers.{index}."
    attn = prefix + "self_attn."
    heads, dim = take.shard.heads, spec.head_dim
    q_rows, kv_rows = heads.q.rows(dim), heads.kv.rows(dim)
    if spec.fused_projections:
        k_at, v_at = spec.num_heads * dim, (spec.num_heads + spec.num_kv_heads) * dim
        qkv = Linear(
            take.rows(
                attn + "qkv_proj.weight", q_rows, _shifted(kv_rows, k_at), _shifted(kv_rows, v_at)
            )
        )
    else:
        parts = {"q": q_rows, "k": kv_rows, "v": kv_rows}
        qkv_weight = torch.cat([take.rows(attn + f"{p}_proj.weight", parts[p]) for p in "qkv"])
        qkv_bias = None
        if spec.qkv_bias:
            qkv_bias = torch.cat([take.rows(attn + f"{p}_proj.bias", parts[p]) for p in "qkv"])
            qkv_bias = qkv_bias.contiguous()
        qkv = Linear(qkv_weight.contiguous(), qkv_bias)
    o_bias = _first_rank_only(take, attn + "o_proj.bias") if spec.o_bias else None
    layer = LayerWeights(
        input_norm=take.norm(prefix + "input_layernorm.weight"),
        qkv=qkv,
        o_proj=Linear(take.columns(attn + "o_proj.weight", q_rows).contiguous(), o_bias),
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


def _shifted(span: slice, by: int) -> slice:
    return slice(span.start + by, span.stop + by)


def _first_rank_only(take: _Taker, name: str) -> torch.Tensor | None:
    """A row-parallel projection's bias: added once, by rank 0, before the partial sums
    meet (every rank adding it would count it `size` times)."""
    bias = take(name)
    return bias if take.shard.rank == 0 else None


def _load_dense_mlp(take: _Taker, mlp: str, spec: ModelSpec, layer: LayerWeights) -> None:
    rows = take.shard.intermediate.rows(1)
    if spec.fused_projections:
        up = _shifted(rows, spec.intermediate_size)
        layer.gate_up = Linear(take.rows(mlp + "gate_up_proj.weight", rows, up).contiguous())
    else:
        gate_up = torch.cat(
            [take.rows(mlp + "gate_proj.weight", rows), take.rows(mlp + "up_proj.weight", rows)]
        )
        layer.gate_up = Linear(gate_up.contiguous())
    layer.down = Linear(take.columns(mlp + "down_proj.weight", rows).contiguous())


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
    rows = take.shard.expert_intermediate.rows(1)
    if take.has(experts + "gate_up_proj"):
        _load_stacked_experts(take, experts, spec, layer, rows)
        return
    for e in range(spec.experts.num_experts):
        weights = [take.rows(f"{experts}{e}.{name}.weight", rows) for name in (gate, up)]
        layer.experts_gate_up.append(Linear(torch.cat(weights).contiguous()))
        layer.experts_down.append(
            Linear(take.columns(f"{experts}{e}.{down}.weight", rows).contiguous())
        )


def _load_stacked_experts(take: _Taker, experts: str, spec, layer: LayerWeights, rows) -> None:
    """Experts stacked as transformers 5 holds them in memory: [E, 2I, H] and [E, H, I]."""
    every = slice(None)
    if take.shard.whole:
        stacked_gate_up, stacked_down = take(experts + "gate_up_proj"), take(experts + "down_proj")
    else:
        up = _shifted(rows, spec.experts.intermediate_size)
        stacked_gate_up = take(experts + "gate_up_proj", (every, rows), (every, up), dim=1)
        stacked_down = take(experts + "down_proj", (every, every, rows))
    layer.experts_gate_up = [Linear(w.contiguous()) for w in stacked_gate_up]
    layer.experts_down = [Linear(w.contiguous()) for w in stacked_down]
