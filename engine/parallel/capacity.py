"""What one rank of a worker holds: its weights' and its KV pool's bytes, from the model's
shapes alone (no weights read), and the refusal of a rank whose weights cannot fit.

`pdserve serve` prints these per pool at start-up (`PDCluster.rank_capacity`), and a
CUDA engine checks its rank's weights against its device before loading any
(`check_weights_fit`): a model too big for a split fails at once, naming the numbers,
instead of running out of memory halfway through the load.
"""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.parallel.shard import ModelShard


def shard_parameters(spec, shard: ModelShard) -> int:
    """Parameters of `shard` of the model `spec` (`ModelSpec`): its projections' slices,
    every norm, its vocabulary rows (twice when the LM head is not tied)."""
    heads, hidden, dim = shard.heads, spec.hidden_size, spec.head_dim
    qkv = hidden * (heads.q.count + 2 * heads.kv.count) * dim
    if spec.qkv_bias:
        qkv += (heads.q.count + 2 * heads.kv.count) * dim
    attention = qkv + heads.q.count * dim * hidden + (hidden if spec.o_bias else 0)
    norms = 2 * hidden + (2 * hidden if spec.gemma_norms else 0) + (2 * dim if spec.qk_norm else 0)
    dense = 3 * hidden * shard.intermediate.count
    total = 0
    for index in range(spec.num_layers):
        sparse = spec.experts is not None and spec.experts.sparse_layers[index]
        mlp = dense
        if sparse:
            experts = spec.experts
            mlp = experts.num_experts * (3 * hidden * shard.expert_intermediate.count + hidden)
        total += attention + norms + mlp
    vocab = shard.vocab.per_rank * hidden
    return total + vocab * (1 if spec.tie_word_embeddings else 2) + hidden


def check_weights_fit(spec, shard: ModelShard, dtype_bytes: int, device: str, share: float) -> None:
    """Raise ModelLoadError when `shard`'s weights alone exceed `share` of the CUDA
    device's memory (`gpu_memory_utilization`). Called by every rank's engine before
    its weights load; a no-op off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return
    total = torch.cuda.mem_get_info(device)[1]
    needed = shard_parameters(spec, shard) * dtype_bytes
    if needed > share * total:
        raise ModelLoadError(
            f"{spec.model_id} at tp={shard.size}: each rank's weights take "
            f"{needed / 2**30:.1f} GiB, more than gpu_memory_utilization={share} of this "
            f"GPU's {total / 2**30:.1f} GiB; raise tp (or the share)"
        )
