"""Checkpoints the engine cannot serve are refused at start-up, each with its reason.

Each case is the tiny Llama (or Qwen2) changed the way a real checkpoint of that kind
differs: a quantization config and its tensors, MLP biases, a missing LM head, tensors
left over or missing, an architecture or variant the forward lacks. The engine must
not start, and its error must name what it refused and why.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from tests.factories import make_engine


def _copy(source, tmp_path, name="model"):
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _edit_config(model_dir, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _edit_tensors(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _refusal(model_dir) -> str:
    with pytest.raises(ModelLoadError) as refused:
        make_engine(model_dir)
    return str(refused.value)


def test_an_fp8_checkpoint_is_refused_not_cast(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path)
    _edit_config(
        model_dir,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8]},
    )

    def to_fp8(tensors):
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(1)

    _edit_tensors(model_dir, to_fp8)

    message = _refusal(model_dir)
    assert "quantized" in message and "'fp8'" in message and "scales" in message


def test_fp8_tensors_without_a_quantization_config_are_refused(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path)

    def to_fp8(tensors):
        name = "model.layers.1.self_attn.q_proj.weight"
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)

    _edit_tensors(model_dir, to_fp8)

    message = _refusal(model_dir)
    assert "model.layers.1.self_attn.q_proj.weight" in message and "float8_e4m3fn" in message


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_checkpoints_say_why_they_are_refused(tiny_llama_dir, tmp_path, method):
    model_dir = _copy(tiny_llama_dir, tmp_path)
    _edit_config(model_dir, quantization_config={"quant_method": method, "bits": 4})

    def pack(tensors):
        name = "model.layers.0.self_attn.q_proj"
        weight = tensors.pop(name + ".weight")
        tensors[name + ".qweight"] = torch.zeros(
            weight.shape[1] // 8, weight.shape[0], dtype=torch.int32
        )
        tensors[name + ".scales"] = torch.ones(1, weight.shape[0])

    _edit_tensors(model_dir, pack)

    message = _refusal(model_dir)
    assert f"'{method}'" in message and "quantized" in message and "qweight" in message


def test_mlp_bias_is_refused(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path)
    _edit_config(model_dir, mlp_bias=True)

    message = _refusal(model_dir)
    assert "mlp_bias" in message and "not implemented" in message


def test_a_missing_lm_head_without_tied_embeddings_is_refused(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path)
    _edit_tensors(model_dir, lambda tensors: tensors.pop("lm_head.weight"))

    message = _refusal(model_dir)
    assert "lm_head.weight" in message and "tie_word_embeddings" in message


def test_a_tied_checkpoint_may_still_carry_its_lm_head_copy(tiny_model_dirs, tmp_path):
    model_dir = _copy(tiny_model_dirs["qwen2"], tmp_path)  # tie_word_embeddings: true

    def add_copy(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    _edit_tensors(model_dir, add_copy)

    engine = make_engine(model_dir)
    assert engine.model.weights.lm_head is engine.model.weights.embed


def test_leftover_tensors_are_named(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path)

    def add_extra(tensors):
        tensors["model.layers.2.mlp.shared_expert.up_proj.weight"] = torch.zeros(4, 4)

    _edit_tensors(model_dir, add_extra)

    message = _refusal(model_dir)
    assert "model.layers.2.mlp.shared_expert.up_proj.weight" in message
    assert "does not use" in message


def test_a_missing_tensor_is_named_with_the_architecture_that_needs_it(tiny_llama_dir, tmp_path):
    model_dir = _copy(tiny_llama_dir, tmp_path)
    _edit_tensors(model_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))

    message = _refusal(model_dir)
    assert "lacks tensor model.layers.1.self_attn.k_proj.weight" in message
    assert "LlamaForCausalLM" in message


@pytest.mark.parametrize(
    "architecture,model_type,missing",
    [
        ("DeepseekV3ForCausalLM", "deepseek_v3", "multi-head latent attention"),
        ("Gemma3ForConditionalGeneration", "gemma3", "vision tower"),
        ("GPT2LMHeadModel", "gpt2", "not implemented"),
    ],
)
def test_unserved_architectures_are_named_with_what_is_missing(
    tiny_llama_dir, tmp_path, architecture, model_type, missing
):
    model_dir = _copy(tiny_llama_dir, tmp_path)
    _edit_config(model_dir, architectures=[architecture], model_type=model_type)

    message = _refusal(model_dir)
    assert architecture in message and missing in message


@pytest.mark.parametrize(
    "changes,named",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_variants_the_forward_lacks_are_refused(tiny_llama_dir, tmp_path, changes, named):
    model_dir = _copy(tiny_llama_dir, tmp_path)
    _edit_config(model_dir, **changes)

    message = _refusal(model_dir)
    assert named in message and "not implemented" in message
