"""What resharding costs a transfer: the same prompts through a live 1 + 1 cluster whose
prefill worker has N ranks and one of one rank, both into a decode worker of one rank.

Called by `pdserve bench tp` (`--transfer-prompts`) after its compute rounds. Each
cluster is real (Ray actors, the shm transport, `first_token_from: decode` so that every
TTFT waits on its transfer, no prefix caching so that every block moves); the figures
are the per-request receipts (`pdserve_timings`): bytes moved, head slices, the transfer's
seconds, and TTFT.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass

OUTPUT_TOKENS = 4
"""Per request: the transfer is done before the first token; the rest only adds time."""


@dataclass
class TransferRun:
    """One cluster's medians over its prompts."""

    prefill_tp: int
    decode_tp: int
    kv_bytes: int
    slices: int
    """Head slices per transfer: one per prefill rank whose heads the decode rank owns."""
    kv_transfer_ms: float
    ttft_ms: float


def measure_resharding(model: str, tp: int, prompt_len: int, prompts: int) -> list[TransferRun]:
    """Prefill tp=`tp` -> decode tp=1, then prefill tp=1 -> decode tp=1, on the same
    `prompts` random prompts of `prompt_len` tokens (after one warm-up request each)."""
    from bench.engine_bench import _prompts
    from engine.demo_model import resolve_model
    from engine.model_spec import load_model_spec

    vocab = load_model_spec(*resolve_model(model)).vocab_size
    token_lists = _prompts(prompts + 1, prompt_len, vocab)
    return [asyncio.run(_one_cluster(model, prefill_tp, token_lists)) for prefill_tp in (tp, 1)]


async def _one_cluster(model: str, prefill_tp: int, token_lists) -> TransferRun:
    from bench.engine_bench import _greedy
    from cluster.config import ClusterConfig
    from cluster.flow.cluster import PDCluster

    prompt_len = len(token_lists[0])
    config = ClusterConfig.from_dict(
        dict(
            model=model,
            dtype="float32",
            prefill={"tp": prefill_tp},
            transport={"name": "shm"},
            first_token_from="decode",
            prefix_caching=False,
            max_model_len=prompt_len + OUTPUT_TOKENS,
            threads_per_worker=1,
            pin_cores=False,  # 2 + 1 processes on 2 cores: no core of its own for each
        )
    )
    params = _greedy(OUTPUT_TOKENS)
    receipts = []
    async with PDCluster(config) as cluster:
        for tokens in token_lists:
            last = None
            async for chunk in cluster.generate(tokens, params):
                last = chunk
            receipts.append(last.timings)
    timed = receipts[1:]  # the first is the warm-up
    return TransferRun(
        prefill_tp=prefill_tp,
        decode_tp=1,
        kv_bytes=int(statistics.median(t["kv_bytes"] for t in timed)),
        slices=int(statistics.median(len(t["kv_slices"]) for t in timed)),
        kv_transfer_ms=statistics.median(t["kv_transfer_s"] for t in timed) * 1e3,
        ttft_ms=statistics.median(t["ttft_s"] for t in timed) * 1e3,
    )


def format_transfer_report(runs: list[TransferRun], prompt_len: int, prompts: int) -> str:
    lines = [
        f"KV transfer of a {prompt_len}-token prompt (shm, float32; medians of {prompts})",
        f"{'prefill -> decode':20} {'KV bytes':>12} {'slices':>7} {'transfer ms':>12} "
        f"{'TTFT ms':>9}",
    ]
    for run in runs:
        label = f"tp={run.prefill_tp} -> tp={run.decode_tp}"
        lines.append(
            f"{label:20} {run.kv_bytes:>12,} {run.slices:>7} {run.kv_transfer_ms:>12.1f} "
            f"{run.ttft_ms:>9.0f}"
        )
    return "\n".join(lines)
