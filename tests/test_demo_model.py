"""The real demo model (SmolLM2-135M-Instruct from the packaged GGUF)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.demo_model import prepare_demo_model
from engine.sampling_params import SamplingParams
from tests.factories import assert_no_leaks, hf_greedy, make_engine

pytestmark = pytest.mark.demo

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


@pytest.fixture(scope="module")
def demo_dir():
    return prepare_demo_model()


def test_generate_cli_answers_paris(demo_dir):
    command = [
        sys.executable,
        "-m",
        "cluster.cli",
        "generate",
        "--model",
        "demo",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "20",
        "--temperature",
        "0",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    assert "Paris" in result.stdout


def test_demo_greedy_equals_transformers(demo_dir):
    engine = make_engine(demo_dir, block_size=16, num_kv_blocks=128)
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    outputs = engine.generate(prompts, params)

    for prompt, seq in zip(prompts, outputs, strict=True):
        assert seq.output_token_ids == hf_greedy(demo_dir, prompt, 24)[0]
    assert_no_leaks(engine)


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(demo_dir):
    """Our bf16 path (bf16 matmuls, float32 residual) strays from the float32 reference
    no further than transformers' own bf16 forward does."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.factories import our_greedy_with_logits

    engine = make_engine(demo_dir, dtype="bfloat16", block_size=16, num_kv_blocks=128)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.bfloat16).eval()
    for question in QUESTIONS:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        reference = hf_greedy(demo_dir, prompt, 1)[1][0]
        ours = our_greedy_with_logits(engine, prompt, 1)[0]
        with torch.no_grad():
            theirs = hf_bf16(torch.tensor([prompt])).logits[0, -1].float()

        def error(logits, reference=reference):
            return float((logits - reference).norm() / reference.norm())

        assert error(ours) <= error(theirs), question
    assert_no_leaks(engine)
