"""KV pools sized from the device: a pool's `kv_blocks` is a count, or unset (`auto`),
which leaves a GPU pool's workers to size their pools from `gpu_memory_utilization` and
gives a CPU pool fixed defaults; pools of fixed blocks are checked before start, sized
ones after, on what their workers report. A real cluster's pool sized from a GPU is
`test_a_cuda_clusters_pool_is_sized_from_the_gpu` in tests/test_gpu.py."""

from __future__ import annotations

import asyncio

import pytest

from cluster.cli.main import build_parser
from cluster.cli.serve import UNFLAGGED
from cluster.config import CPU_POOL_KV_BLOCKS, ClusterConfig, ConfigError
from cluster.config_flags import config_overrides
from cluster.control.controller import Controller
from cluster.control.worker_info import WorkerInfo
from cluster.flow.cluster import PDCluster
from worker.messages import HealthReport

GPU = {"gpus_per_worker": 1}


def flags_config(*flags: str) -> ClusterConfig:
    args = build_parser().parse_args(["serve", *flags])
    return ClusterConfig.load(None, config_overrides(args, ClusterConfig, UNFLAGGED))


# --- the key and its flag ---------------------------------------------------------------


@pytest.mark.parametrize(("value", "blocks"), [("auto", None), (None, None), (300, 300)])
def test_kv_blocks_is_a_count_or_auto_in_yaml(tmp_path, value, blocks):
    path = tmp_path / "pdserve.yaml"
    path.write_text(f"decode:\n  kv_blocks: {'null' if value is None else value}\n")
    config = ClusterConfig.load(path)
    assert config.decode.kv_blocks == blocks
    assert config.prefill.kv_blocks is None  # unset by default


def test_the_pool_flags_take_a_count_or_auto():
    config = flags_config("--prefill-kv-blocks", "300", "--decode-kv-blocks", "auto")
    assert (config.prefill.kv_blocks, config.decode.kv_blocks) == (300, None)
    with pytest.raises(SystemExit):
        flags_config("--decode-kv-blocks", "lots")


def test_auto_overrides_a_count_from_the_file(tmp_path):
    path = tmp_path / "pdserve.yaml"
    path.write_text("decode:\n  workers: 2\n  kv_blocks: 300\n")
    args = build_parser().parse_args(["serve", "--decode-kv-blocks", "auto"])
    config = ClusterConfig.load(path, config_overrides(args, ClusterConfig, UNFLAGGED))
    assert (config.decode.workers, config.decode.kv_blocks) == (2, None)


@pytest.mark.parametrize("value", [0, "AUTO", True, 1.5])
def test_anything_else_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"decode\.kv_blocks must be an integer >= 1 or 'auto'"):
        ClusterConfig.from_dict({"decode": {"kv_blocks": value}})


# --- what each pool's workers get -------------------------------------------------------


def test_cpu_pools_keep_fixed_defaults_and_counts_override_them():
    config = ClusterConfig()
    assert CPU_POOL_KV_BLOCKS == {"prefill": 1024, "decode": 2048}
    for role in ("prefill", "decode"):
        assert config.kv_blocks(role) == CPU_POOL_KV_BLOCKS[role]
        assert config.engine_config(role).num_kv_blocks == CPU_POOL_KV_BLOCKS[role]
    assert config.kv_blocks("colocated") == CPU_POOL_KV_BLOCKS["decode"]
    assert config.worker_spec("decode-0", "decode").engine.num_kv_blocks == 2048
    fixed = config.replace(prefill={"kv_blocks": 300})
    assert fixed.engine_config("prefill").num_kv_blocks == 300


def test_gpu_pools_leave_their_size_to_the_engine():
    """Nothing starts: the worker's engine config is built as the controller builds it."""
    config = ClusterConfig.from_dict(GPU)
    for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        engine = config.worker_spec(worker_id, role).engine
        assert engine.device == "cuda" and engine.num_kv_blocks is None
        assert engine.sizes_kv_from_device and engine.usable_kv_blocks is None
    colocated = ClusterConfig.from_dict({**GPU, "mode": "colocated"})
    assert colocated.worker_spec("colocated-0", "colocated").engine.sizes_kv_from_device


def test_a_count_overrides_the_device_on_gpu_pools():
    config = ClusterConfig.from_dict({**GPU, "decode": {"kv_blocks": 500}})
    assert config.engine_config("decode").num_kv_blocks == 500
    assert not config.engine_config("decode").sizes_kv_from_device
    assert config.engine_config("prefill").num_kv_blocks is None


def test_only_fixed_pools_are_checked_before_start():
    sized = ClusterConfig.from_dict({**GPU, "block_size": 16})
    sized.check_pools(1_000_000)  # the workers size these: checked after start
    fixed = sized.replace(decode={"kv_blocks": 33})
    fixed.check_pools(512)  # 32 blocks + the CUDA graphs' scratch
    with pytest.raises(ConfigError, match=r"decode\.kv_blocks=33 cannot hold one 513-token"):
        fixed.check_pools(513)


def test_workers_sharing_a_gpu_must_split_its_memory():
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization to at most 0\.5"):
        ClusterConfig.from_dict({"gpus_per_worker": 0.5})
    ClusterConfig.from_dict({"gpus_per_worker": 0.5, "gpu_memory_utilization": 0.45})
    fixed = {"prefill": {"kv_blocks": 64}, "decode": {"kv_blocks": 64}}
    ClusterConfig.from_dict({"gpus_per_worker": 0.5, **fixed})  # nothing sized from it
    with pytest.raises(ConfigError, match=r"with prefill\.kv_blocks unset"):
        ClusterConfig.from_dict({"gpus_per_worker": 0.5, "decode": {"kv_blocks": 64}})


# --- pools sized from the device, after start -------------------------------------------


def report(worker_id: str, role: str, total_blocks: int) -> HealthReport:
    return HealthReport(
        worker_id, role, queue_depth=0, free_blocks=total_blocks, total_blocks=total_blocks,
        num_running=0, num_waiting=0, num_threads=1, pid=1,
    )  # fmt: skip


def test_the_controller_reports_the_smallest_pool_of_each_role():
    controller = Controller(ClusterConfig.from_dict(GPU))
    assert controller.kv_capacity("decode") is None  # no worker has reported yet
    for worker_id, role, blocks in [
        ("prefill-0", "prefill", 700),
        ("decode-0", "decode", 900),
        ("decode-1", "decode", 800),
    ]:
        controller.workers[worker_id] = WorkerInfo(worker_id, role, handle=None)
        controller.workers[worker_id].load = report(worker_id, role, blocks)
    controller.workers["decode-2"] = WorkerInfo("decode-2", "decode", handle=None)  # not yet
    assert (controller.kv_capacity("prefill"), controller.kv_capacity("decode")) == (700, 800)
    colocated = Controller(ClusterConfig.from_dict({**GPU, "mode": "colocated"}))
    colocated.workers["colocated-0"] = WorkerInfo("colocated-0", "colocated", handle=None)
    colocated.workers["colocated-0"].load = report("colocated-0", "colocated", 500)
    assert colocated.kv_capacity("decode") == 500


def fake_workers(cluster: PDCluster, blocks: dict[str, int]) -> list[str]:
    """Makes `cluster.start()` start, without Ray, one worker per role of `blocks` that
    reports that many blocks; returns the list the controller's shutdown appends to."""
    stopped = []

    async def start() -> None:
        for role, total in blocks.items():
            worker = WorkerInfo(f"{role}-0", role, handle=None)
            worker.load = report(worker.worker_id, role, total)
            cluster.controller.workers[worker.worker_id] = worker

    async def shutdown() -> None:
        stopped.append("shutdown")

    cluster.controller.start, cluster.controller.shutdown = start, shutdown
    return stopped


def gpu_cluster(model_dir, **settings) -> PDCluster:
    """A GPU pool's cluster, built (not started) on any machine: nothing here touches CUDA."""
    return PDCluster(
        ClusterConfig.from_dict(
            {"model": str(model_dir), "block_size": 8, "max_model_len": 512, **GPU, **settings}
        )
    )


def test_a_sized_pool_too_small_for_one_sequence_is_refused_after_start(tiny_llama_dir):
    """1. the workers start and report; 2. the decode pool holds 63 blocks of the 64 one
    512-token sequence takes; 3. start raises, naming the pool, after stopping them."""
    cluster = gpu_cluster(tiny_llama_dir)
    stopped = fake_workers(cluster, {"prefill": 64, "decode": 63})
    with pytest.raises(ConfigError) as refused:
        asyncio.run(cluster.start())
    message = str(refused.value)
    assert "the decode pool's workers sized their KV pools from gpu_memory_utilization 0.9" in (
        message
    )
    assert "63 usable blocks, which cannot hold one 512-token sequence (64 blocks of 8)" in message
    assert "or set decode.kv_blocks" in message
    assert stopped == ["shutdown"]


def test_a_sized_prefill_pool_is_checked_too(tiny_llama_dir):
    cluster = gpu_cluster(tiny_llama_dir)
    stopped = fake_workers(cluster, {"prefill": 10, "decode": 64})
    with pytest.raises(ConfigError, match="the prefill pool's workers sized"):
        asyncio.run(cluster.start())
    assert stopped == ["shutdown"]


def test_sized_pools_are_printed_after_start_with_what_they_hold(tiny_llama_dir):
    cluster = gpu_cluster(tiny_llama_dir, prefill={"kv_blocks": 200})
    prefill, decode = cluster.rank_capacity()
    assert "KV 200 blocks x " in prefill
    assert "KV blocks of " in decode and "sized at start from gpu_memory_utilization 0.9" in decode
    stopped = fake_workers(cluster, {"prefill": 199, "decode": 130})
    asyncio.run(cluster.start())
    assert stopped == []
    assert cluster.sized_pool_capacity() == [
        "decode workers: KV sized from gpu_memory_utilization 0.9: 130 blocks of 8 tokens "
        "per worker, at most 2 concurrent 512-token sequences"
    ]  # the prefill pool's blocks are fixed: printed before start, not here
    assert cluster.pool_blocks("decode") == 130  # what requests are admitted by
    assert cluster.pool_blocks("prefill") == 199  # 200 less the CUDA graphs' scratch


def test_cpu_pools_print_no_sized_line(tiny_llama_dir):
    cluster = PDCluster(ClusterConfig.from_dict({"model": str(tiny_llama_dir), "block_size": 8}))
    fake_workers(cluster, {"prefill": 1024, "decode": 2048})
    asyncio.run(cluster.start())
    assert cluster.sized_pool_capacity() == []
    assert "KV 2048 blocks x " in cluster.rank_capacity()[1]
