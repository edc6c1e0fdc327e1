"""The real demo model (SmolLM2-135M-Instruct from the packaged GGUF)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.demo_model import prepare_demo_model
from engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks, make_engine
from tests.factories import hf_greedy

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
