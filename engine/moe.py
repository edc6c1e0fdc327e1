"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE), experts computed grouped.

The router scores every token against every expert; each token goes to its `top_k`
experts, weighted by the softmax over all experts' logits (in float32), renormalised
over the chosen ones where the family does (Mixtral always, Qwen3-MoE when
`norm_topk_prob`). The (token, expert) pairs are then sorted by expert, so that each
expert runs one gated-MLP matmul pair over all of its tokens in the step, never one
token at a time; the results are weighted and scattered back with one `index_add_`.

`LlamaForward` calls `moe_mlp` per MoE layer, on either op set (`engine.layer_ops`).
"""

from __future__ import annotations

import torch

from engine.layer_ops import RESIDUAL_DTYPE, glu, project
from engine.model_spec import ExpertsSpec


def route(router_logits: torch.Tensor, experts: ExpertsSpec):
    """(weights [T, k] float32, chosen expert ids [T, k]) of each token, as transformers'
    routers compute them."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, experts.top_k, dim=-1)
    if experts.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def moe_mlp(ops, normed: torch.Tensor, layer, experts: ExpertsSpec, activation: str):
    """The mixture's output [T, hidden] (float32) for the normed hidden states [T, hidden]."""
    weights, chosen = route(project(ops, normed, layer.router), experts)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    tokens = order // experts.top_k
    pair_weights = weights.flatten()[order]
    out = torch.zeros(normed.shape[0], normed.shape[1], dtype=RESIDUAL_DTYPE, device=normed.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        hidden = normed.index_select(0, rows)
        gate_up = project(ops, hidden, layer.experts_gate_up[expert])
        down = project(ops, glu(gate_up, activation), layer.experts_down[expert])
        out.index_add_(0, rows, down.float() * pair_weights[start : start + count, None])
        start += count
    return out
