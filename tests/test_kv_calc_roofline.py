"""kv-calc and roofline arithmetic against hand computations; the CLIs end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.hardware import hardware_profile, measure_cpu
from bench.kv_calc import kv_bytes_per_token, kv_capacity, parse_bytes
from bench.model_shape import load_shape, shape_from_config, total_params
from bench.roofline import decode_step, prefill_step, roofline

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


@pytest.fixture
def llama8b():
    return shape_from_config(LLAMA3_8B, "llama-3-8b")


@pytest.fixture
def demo():
    return load_shape("demo")


def test_llama3_8b_kv_bytes_and_capacity_by_hand(llama8b):
    # 2 (K, V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 128 KiB per token.
    assert kv_bytes_per_token(llama8b, "bfloat16") == 131_072
    # Params: 32 x (2*4096*4096 + 2*4096*1024 + 3*4096*14336) + 65 norms x 4096
    #         + 2 x 4096 x 128256 (untied embedding and LM head) = 8,030,261,248.
    assert total_params(llama8b) == 8_030_261_248

    c = kv_capacity(llama8b, "bfloat16", block_size=16, device_memory=parse_bytes("80GiB"))

    assert c.kv_bytes_per_block == 16 * 131_072
    assert c.blocks_per_request == 4096 // 16
    assert c.kv_bytes_per_request == 256 * 16 * 131_072  # 512 MiB
    # 80 GiB x 0.9 = 77,309,411,328 minus 16,060,522,496 of weights.
    assert c.kv_budget_bytes == 61_248_888_832
    assert c.kv_blocks_fit == 29_205
    assert c.kv_tokens_fit == 467_280
    assert c.requests_fit == 114
    assert "not speed" in c.note


def test_tensor_parallel_splits_kv_heads_and_weights(llama8b):
    assert kv_bytes_per_token(llama8b, "bfloat16", tp=4) == 131_072 // 4
    assert kv_bytes_per_token(llama8b, "bfloat16", tp=16) == 131_072 // 8  # one head per rank
    assert kv_capacity(llama8b, tp=2).weight_bytes_per_rank == 8_030_261_248


def test_demo_model_kv_by_hand(demo):
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, tied embeddings.
    assert kv_bytes_per_token(demo, "float32") == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(demo, "bfloat16") == 23_040
    assert total_params(demo) == 134_515_008

    c = kv_capacity(demo, "float32", device_memory=24 << 30, context=2048)

    assert c.kv_bytes_per_block == 737_280
    assert c.weight_bytes_per_rank == 538_060_032
    assert (c.kv_blocks_fit, c.kv_tokens_fit, c.requests_fit) == (30_727, 491_632, 240)


def test_sizes_parse_binary_and_decimal():
    assert parse_bytes("80GiB") == 80 << 30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("24G") == 24 << 30
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_h100_batch1_decode_is_memory_bound_and_2k_prefill_compute_bound(demo, llama8b):
    h100 = hardware_profile("h100")
    for model in (demo, llama8b):
        decode = decode_step(model, h100, batch=1, context=2048, dtype="bfloat16")
        prefill = prefill_step(model, h100, batch=1, prompt=2048, dtype="bfloat16")
        assert decode.bound == "memory" and decode.intensity < decode.ridge
        assert decode.lower_bound_s == decode.memory_s
        assert prefill.bound == "compute" and prefill.intensity > prefill.ridge
        assert prefill.lower_bound_s == prefill.compute_s
    assert h100.ridge("bfloat16") == pytest.approx(989.4e12 / 3.35e12)


def test_decode_step_counts_by_hand(llama8b):
    h100 = hardware_profile("h100")
    step = decode_step(llama8b, h100, batch=1, context=1000, dtype="bfloat16")
    linear = 32 * 218_103_808 + 4096 * 128256  # projections + LM head, per token
    attention = 4 * 32 * 128 * 1001 * 32  # 1000 cached keys + its own
    assert step.flops == 2 * linear + attention
    assert step.weight_bytes == 2 * (linear + 65 * 4096)
    assert step.kv_read_bytes == 1000 * 131_072
    assert step.kv_write_bytes == 131_072
    assert step.memory_s == pytest.approx(step.bytes_moved / 3.35e12)


def test_batching_moves_decode_toward_the_ridge(demo):
    h100 = hardware_profile("h100")
    steps = [roofline(demo, h100, batch=b, prompt=256)["decode"] for b in (1, 16, 256)]
    assert steps[0].intensity < steps[1].intensity < steps[2].intensity


def test_cpu_profile_is_measured_here():
    cpu = measure_cpu(("float32", "bfloat16"), None, num_bytes=32 << 20, matmul_n=256)
    assert cpu.measured and cpu.name == "cpu"
    assert cpu.memory_bandwidth > 1e8 and cpu.memory_bytes > 1 << 30
    assert cpu.flops("float32") > 1e8 and cpu.flops("bfloat16") > 1e7
    assert cpu.ridge("float32") == cpu.flops("float32") / cpu.memory_bandwidth
    with pytest.raises(ValueError):
        cpu.flops("fp8")


def test_roofline_cli_prints_json():
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "roofline", "--hardware", "a100", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["hardware"]["name"] == "a100" and report["decode"]["dtype"] == "bfloat16"
    assert report["decode"]["bound"] == "memory" and report["decode"]["lower_bound_s"] > 0


def test_kv_calc_cli_with_a_config_file(tmp_path):
    config = tmp_path / "llama3-8b.json"
    config.write_text(json.dumps(LLAMA3_8B))
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "kv-calc", "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kv_bytes_per_token"] == 131_072
