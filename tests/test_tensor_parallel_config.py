"""Tensor parallelism's configuration: the pool keys and their flags, what is refused
before anything starts (with both pools named), what each rank asks Ray for, the
per-rank capacity, and which process a drill kills."""

from __future__ import annotations

import os

import pytest
import torch

from bench.drill import victim_rank
from bench.drill_report import KillEvent, format_report
from cluster.cli.main import build_parser
from cluster.cli.serve import config_from_args
from cluster.config import ClusterConfig, ConfigError
from cluster.control.core_plan import plan_cores
from engine.model_spec import load_model_spec
from engine.parallel.capacity import shard_parameters
from engine.parallel.shard import ModelShard
from engine.weights import load_weights


def test_the_tp_flags_set_the_pool_keys():
    args = build_parser().parse_args(["serve", "--decode-tp", "2", "--prefill-tp", "1"])
    config = config_from_args(args)
    assert (config.prefill.tp, config.decode.tp) == (1, 2)
    spec = config.worker_spec("decode-0", "decode")
    assert (spec.tp_size, spec.rank_resources, spec.rank_gpus) == (2, {"decode_pool": 0.5}, 0.0)
    assert config.worker_spec("prefill-0", "prefill").tp_size == 1


def test_a_worker_takes_one_pool_unit_and_a_gpu_per_rank():
    config = ClusterConfig.from_dict({"decode": {"tp": 4}, "gpus_per_worker": 1})
    spec = config.worker_spec("decode-0", "decode")
    assert spec.rank_resources == {"decode_pool": 0.25}
    assert spec.rank_gpus == 1.0
    assert config.gpus_per_rank("prefill") == 1.0  # tp=1: gpus_per_worker as it is
    fractional = ClusterConfig.from_dict({"gpus_per_worker": 0.5, "gpu_memory_utilization": 0.45})
    assert fractional.gpus_per_rank("decode") == 0.5


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"decode": {"tp": 2}, "gpus_per_worker": 0.5}, "one whole GPU per rank"),
        ({"prefill": {"tp": 2}, "prestarted_workers": 1}, "standby_workers"),
        ({"decode": {"tp": 0}}, "decode.tp must be an integer >= 1"),
    ],
)
def test_what_tensor_parallel_pools_cannot_do_is_refused(settings, says):
    with pytest.raises(ConfigError, match=says):
        ClusterConfig.from_dict(settings)


def test_a_split_the_model_cannot_take_is_refused_naming_both_pools(tp_model_dirs):
    spec = load_model_spec(tp_model_dirs["llama_kv2"])  # 8 heads, 2 KV heads
    config = ClusterConfig.from_dict({"prefill": {"tp": 2}, "decode": {"tp": 3}})
    with pytest.raises(ConfigError) as caught:
        config.check_tp(spec)
    message = str(caught.value)
    assert "decode.tp=3 cannot serve" in message and "prefill.tp=2 and decode.tp=3" in message
    assert "8 attention heads" in message
    # 4 ranks over 2 KV heads replicate them; 2 and 4 ranks exchange KV by head slices.
    ClusterConfig.from_dict({"prefill": {"tp": 2}, "decode": {"tp": 4}}).check_tp(spec)


def test_threads_are_shared_by_ranks_and_ranks_are_not_pinned():
    config = ClusterConfig.from_dict({"decode": {"tp": 2}})
    assert config.worker_threads == max(1, (os.cpu_count() or 1) // 3)
    assert plan_cores(config, list(range(64))) is None
    assert plan_cores(ClusterConfig(), list(range(64))) is not None


@pytest.mark.parametrize(("family", "size"), [("llama_kv2", 2), ("qwen2", 2), ("mistral_kv1", 2)])
def test_capacity_counts_each_ranks_parameters(tp_model_dirs, family, size):
    model_dir = tp_model_dirs[family]
    spec = load_model_spec(model_dir)
    for rank in range(size):
        shard = ModelShard.of(spec, size, rank)
        weights = load_weights(model_dir, spec, torch.float32, "cpu", shard)
        tensors = [p.weight for layer in weights.layers for p in layer.projections().values()]
        tensors += [p.bias for layer in weights.layers for p in layer.projections().values()]
        tensors += [n for layer in weights.layers for n in layer.norms().values()]
        tensors += [weights.final_norm, weights.lm_head.weight]
        if weights.embed is not weights.lm_head:
            tensors.append(weights.embed.weight)
        loaded = sum(t.numel() for t in tensors if t is not None)
        assert shard_parameters(spec, shard) == loaded


def test_a_drill_kills_the_rank_it_is_told_and_says_so():
    worker = {"worker_id": "decode-0", "role": "decode", "pid": 10, "rank_pids": [10, 11, 12]}
    assert victim_rank(worker, 0) == (0, 10)
    assert victim_rank(worker, 2) == (2, 12)
    assert victim_rank(worker, 5) == (2, 12)  # past its ranks: its last
    assert victim_rank({"pid": 7}, 1) == (0, 7)  # one rank, no rank_pids listed
    drawn = {victim_rank(worker, "random") for _ in range(64)}
    assert drawn == {(0, 10), (1, 11), (2, 12)}
    kill = KillEvent(1.0, "decode-0", "decode", 11, 3, rank=1, worker_pid=10)
    from bench.drill_report import DrillReport

    report = DrillReport(3, 3, 3, 0, 0, 3, 0, 0, 0, None, None, kills=[kill], kills_planned=1)
    assert "killed decode-0 rank 1 (pid 11, 3 requests)" in format_report(report)
