"""The quick config and tokenizer readers agree with transformers' own loaders.

Workers read config.json as JSON (a second of every restart saved); the tokenizer is
AutoTokenizer's, cached. These tests pin the shortcut to what AutoConfig and
AutoTokenizer build, and check it steps aside when transformers has to fill in.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from engine.model_spec import load_model_spec, plain_config, spec_from_hf_config
from engine.rope import RotaryEmbedding
from engine.tokenizer import Tokenizer


def _fields(spec) -> dict:
    return {k: v for k, v in dataclasses.asdict(spec).items() if k != "hf_config"}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_plain_config_gives_the_spec_and_rope_of_autoconfig(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    fast = load_model_spec(model_dir)
    reference = spec_from_hf_config(AutoConfig.from_pretrained(model_dir), model_dir.name)
    assert _fields(fast) == _fields(reference)
    assert fast.context_window == reference.context_window
    tables = [RotaryEmbedding(s.hf_config, 64, torch.float32, "cpu") for s in (fast, reference)]
    assert torch.equal(tables[0].cos, tables[1].cos) and torch.equal(tables[0].sin, tables[1].sin)


def test_plain_config_steps_aside_when_transformers_must_fill_in(tiny_llama_dir):
    fields = json.loads((tiny_llama_dir / "config.json").read_text())
    assert plain_config(fields) is not None
    scaled = {**fields, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    assert plain_config(scaled) is None
    assert plain_config({k: v for k, v in fields.items() if k != "tie_word_embeddings"}) is None
    assert plain_config({**fields, "architectures": ["GPT2LMHeadModel"], "model_type": "x"}) is None


def test_tokenizer_matches_autotokenizer(tiny_llama_dir):
    ours = Tokenizer(tiny_llama_dir).hf
    reference = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert type(ours) is type(reference)
    text = "Grüße aus Köln! 東京 🙂 def main():\n\treturn 42 </s>"
    ids = reference.encode(text)
    assert ours.encode(text) == ids
    assert ours.decode(ids) == reference.decode(ids)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == (
        reference.apply_chat_template(chat, add_generation_prompt=True)
    )
