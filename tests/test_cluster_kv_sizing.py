"""KV pools sized from the device: a pool's `kv_blocks` is a count, or unset (`auto`),
which leaves a GPU pool's workers to size their pools from `gpu_memory_utilization` and
gives a CPU pool fixed defaults; pools of fixed blocks are checked before start, sized
ones after, on what their workers report."""

from __future__ import annotations

import pytest

from cluster.cli.main import build_parser
from cluster.cli.serve import UNFLAGGED
from cluster.config import CPU_POOL_KV_BLOCKS, ClusterConfig, ConfigError
from cluster.config_flags import config_overrides

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
