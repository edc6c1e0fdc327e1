"""Tensor-parallel workers in live clusters (2 ranks, one thread each, on loopback):
greedy output equal to one rank's (transformers' is one rank's, tests/test_tensor_parallel.py),
the ranks' processes listed, KV moved between different splits with the bytes of each
head slice in the receipt, no block or lease left on any rank, and a split the model
cannot take refused before any process starts."""

from __future__ import annotations

import psutil
import pytest
import ray

from cluster.api.frontend import _liveness
from cluster.config import ConfigError
from cluster.flow.cluster import PDCluster
from engine.kv_cache import KVLayout
from engine.model_spec import load_model_spec
from engine.parallel.shard import ModelShard
from tests.cluster_helpers import (
    assert_cluster_leak_free,
    collect,
    generate_all,
    mixed_prompts,
    reference_outputs,
    run_cluster,
    tiny_cluster_config,
)

PROMPTS = mixed_prompts(6)


def test_a_colocated_worker_of_two_ranks_equals_one_rank(tp_model_dirs):
    model_dir = tp_model_dirs["llama_kv2"]
    expected = reference_outputs(model_dir, PROMPTS)
    config = tiny_cluster_config(model_dir, mode="colocated", decode={"tp": 2})

    async def scenario(cluster):
        outputs = await generate_all(cluster, PROMPTS)
        await assert_cluster_leak_free(cluster)
        row = _liveness(cluster.controller.workers["colocated-0"])
        assert row["tp_size"] == 2
        rank0, rank1 = row["rank_pids"]
        assert rank0 == row["pid"] and rank1 != rank0
        assert psutil.Process(rank1).is_running()
        return outputs, row["rank_pids"]

    outputs, pids = run_cluster(config, scenario)
    assert outputs == expected
    assert_gone(pids)


def assert_gone(pids: list[int], wait_s: float = 10.0) -> None:
    """No process of a stopped worker's ranks is left."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "transport"),
    [(2, 1, "shm"), (1, 2, "collective")],
)
def test_kv_moves_between_splits_and_decodes_as_one_rank(
    tp_model_dirs, prefill_tp, decode_tp, transport
):
    """Prefill tp=2 -> decode tp=1: decode rank 0 pulls each prefill rank's head. Prefill
    tp=1 -> decode tp=2: each decode rank pulls the whole blocks and keeps its head. A
    prompt sent again finds its blocks in the decode worker's prefix cache (every rank's
    pool holds them) and pulls only the rest."""
    model_dir = tp_model_dirs["llama_kv2"]
    prompts = [*PROMPTS, PROMPTS[-1] + [7, 8]]
    expected = reference_outputs(model_dir, prompts)
    config = tiny_cluster_config(
        model_dir,
        prefill={"tp": prefill_tp},
        decode={"tp": decode_tp},
        transport={"name": transport},
    )

    async def scenario(cluster):
        outputs = await generate_all(cluster, prompts[:-1])
        again, last = await collect(cluster, prompts[-1])
        await assert_cluster_leak_free(cluster)
        states = await cluster.controller.debug_states()
        return [*outputs, again], last.timings, states

    outputs, timings, states = run_cluster(config, scenario)
    assert outputs == expected
    assert timings["transfer_failure"] is None and not timings["recomputed"]
    assert timings["transport"] == transport and timings["decode_reused_blocks"] > 0
    spec = load_model_spec(model_dir)
    moved = timings["kv_blocks_moved"]
    slices = timings["kv_slices"]
    assert len(slices) == 2  # one per head, from prefill rank h (2 -> 1) or to decode rank h
    for head, receipt in enumerate(sorted(slices, key=lambda r: r["first_kv_head"])):
        sender = KVLayout.for_model(spec, "float32", 8, ModelShard.of(spec, prefill_tp, 0))
        assert receipt["kv_heads"] == 1 and receipt["first_kv_head"] == head
        assert receipt["num_bytes"] == sender.block_nbytes * moved
        assert receipt["staged"] and receipt["checksum"] == "xxh3_64"
        rank = "sender_rank" if prefill_tp == 2 else "receiver_rank"
        assert receipt[rank] == head
    assert timings["kv_bytes"] == sum(r["num_bytes"] for r in slices)
    assert states["prefill-0"]["rank_leases"] == ([[]] if prefill_tp == 2 else [])


def test_a_split_the_model_cannot_take_starts_nothing(tp_model_dirs):
    """Refused at start-up naming both pools: no Ray, no worker, no process."""
    model_dir = tp_model_dirs["llama_kv2"]  # 8 heads, 2 KV heads
    config = tiny_cluster_config(model_dir, prefill={"tp": 2}, decode={"tp": 3})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match=r"decode.tp=3 cannot serve .* with prefill.tp=2"):
        PDCluster(config)
    assert not ray.is_initialized()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
