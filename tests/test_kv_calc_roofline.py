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


# --- the families beyond Llama: real configs' KV per token, by hand -----------------------

QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
    "sliding_window": None, "use_sliding_window": False,
}  # fmt: skip
GEMMA2_9B = {
    "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "vocab_size": 256000, "tie_word_embeddings": True, "sliding_window": 4096,
}  # fmt: skip
MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "tie_word_embeddings": False, "num_local_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": None,
}  # fmt: skip
MISTRAL_7B_V01 = {
    "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "tie_word_embeddings": False, "sliding_window": 4096,
}  # fmt: skip
PHI3_MINI_4K = {
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32064, "tie_word_embeddings": False, "sliding_window": 2047,
}  # fmt: skip
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
    "mlp_only_layers": [], "decoder_sparse_step": 1, "use_sliding_window": False,
}  # fmt: skip
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "vocab_size": 129280, "tie_word_embeddings": False,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
}  # fmt: skip


@pytest.mark.parametrize(
    "config,per_token,params",
    [
        # 2 (K, V) x 36 layers x 8 KV heads x 128 x 2 bytes; 36 x (attention + MLP +
        # 2 norms + q/k norms) + final norm + untied embedding and LM head.
        (QWEN3_8B, 2 * 36 * 8 * 128 * 2, 8_190_735_360),
        # head_dim 256 over 42 layers; 4 norms a layer, tied embedding.
        (GEMMA2_9B, 2 * 42 * 8 * 256 * 2, 9_241_705_984),
        # KV like Mistral's; every layer holds 8 experts and a router of 8 x 4096.
        (MIXTRAL_8X7B, 2 * 32 * 8 * 128 * 2, 46_702_792_704),
        (PHI3_MINI_4K, 2 * 32 * 32 * 96 * 2, None),
        # 48 layers x 4 KV heads x 128; 128 experts of 768 in every layer.
        (QWEN3_30B_A3B, 2 * 48 * 4 * 128 * 2, 30_532_122_624),
        # MLA caches one latent of 512 + 64 per layer, not K and V of 128 heads.
        (DEEPSEEK_V3, 61 * (512 + 64) * 2, None),
    ],
)
def test_kv_bytes_per_token_of_each_familys_real_config(config, per_token, params):
    shape = shape_from_config(config, config["model_type"])
    assert kv_bytes_per_token(shape, "bfloat16") == per_token
    if params is not None:
        assert total_params(shape) == params


def test_sliding_windows_cap_a_request_only_when_every_layer_slides():
    mistral = shape_from_config(MISTRAL_7B_V01, "mistral-7b-v0.1")
    gemma = shape_from_config(GEMMA2_9B, "gemma-2-9b")
    assert gemma.layer_windows == (4096, None) * 21  # alternating, global layers keep all

    capped = kv_capacity(mistral, context=32768, block_size=16)
    full = kv_capacity(gemma, context=32768, block_size=16)

    # The window's 256 blocks plus the one a new token opens before the oldest goes.
    assert capped.blocks_per_request == 4096 // 16 + 1 and capped.sliding_window == 4096
    assert capped.kv_bytes_per_request == 257 * 16 * 131_072
    assert full.blocks_per_request == 32768 // 16 and full.sliding_window is None
    assert kv_capacity(mistral, context=1000, block_size=16).blocks_per_request == 63


def test_a_mixture_streams_only_routed_experts_in_the_roofline():
    mixtral = shape_from_config(MIXTRAL_8X7B, "mixtral")
    one = decode_step(mixtral, hardware_profile("h100"), batch=1, context=512, dtype="bfloat16")
    many = decode_step(mixtral, hardware_profile("h100"), batch=64, context=512, dtype="bfloat16")
    # batch 1 reads 2 of 8 experts per layer; 64 tokens x 2 read all 8
    expert = 3 * 4096 * 14336
    assert many.weight_bytes - one.weight_bytes == 32 * 6 * expert * 2
