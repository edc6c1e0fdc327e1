"""Tensor-parallel workers in live clusters (2 ranks, one thread each, on loopback):
greedy output equal to one rank's, the ranks' processes listed, and no block left on
any rank."""

from __future__ import annotations

import psutil

from cluster.api.frontend import _liveness
from tests.cluster_helpers import (
    assert_cluster_leak_free,
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
