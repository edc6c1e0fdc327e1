"""The Rust-tokenizer fast path: identical to transformers, and workers start without it.

`Tokenizer` encodes and decodes with the `tokenizers` object transformers builds,
cached on disk (`engine/backend_cache.py`). Every call must give what transformers
gives, whether the object was just built or loaded from the cache, and a worker that
finds the cache must not import transformers at all (a second of every restart).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from engine import backend_cache
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " Grüße aus Köln",
    "東京は晴れです。",
    "<s>user says</s> hi",
    "  two  spaces\nnew line",
    " emoji 🙂🚀 done",
    "",
]


@pytest.fixture()
def tokenizer_cache(tmp_path, monkeypatch):
    cache = tmp_path / "tokenizers"
    monkeypatch.setenv("PDSERVE_TOKENIZER_CACHE", str(cache))
    return cache


def transformers_tokenizer(model_dir):
    """The transformers object `Tokenizer` would otherwise call, built afresh."""
    return Tokenizer(model_dir).hf


def assert_same_as_transformers(ours: Tokenizer, hf) -> None:
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=True), text
    draw = random.Random(0)
    for _ in range(100):
        ids = [draw.randrange(len(hf)) for _ in range(draw.randrange(1, 12))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids
        assert ours.token_text(ids[0]) == hf.decode([ids[0]], skip_special_tokens=False)
    assert ours.vocab_size == len(hf)
    chat = [{"role": "user", "content": "hi there"}]
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat) == hf.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_built_and_cached_tokenizers_match_transformers(tiny_model_dirs, family, tokenizer_cache):
    model_dir = tiny_model_dirs[family]
    hf = transformers_tokenizer(model_dir)

    built = Tokenizer(model_dir)
    assert len(list(tokenizer_cache.iterdir())) == 1
    cached = Tokenizer(model_dir)

    assert "hf" not in vars(cached)  # loaded from the cache: transformers never asked
    assert built.eos_token_ids == cached.eos_token_ids == {hf.eos_token_id}
    assert_same_as_transformers(built, hf)
    assert_same_as_transformers(cached, hf)


def test_a_changed_tokenizer_file_is_a_new_cache_entry(tiny_llama_dir, tmp_path, tokenizer_cache):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    Tokenizer(model_dir)
    settings_file = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings["eos_token"] = "<s>"
    settings_file.write_text(json.dumps(settings))

    changed = Tokenizer(model_dir)

    assert len(list(tokenizer_cache.iterdir())) == 2
    assert 0 in changed.eos_token_ids  # "<s>" is id 0 in the tiny vocabulary


def test_text_clean_up_decodes_through_transformers_and_is_not_cached(
    tiny_llama_dir, tmp_path, tokenizer_cache
):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    settings_file = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings["clean_up_tokenization_spaces"] = True
    settings_file.write_text(json.dumps(settings))

    ours = Tokenizer(model_dir)

    assert not tokenizer_cache.exists() or not list(tokenizer_cache.iterdir())
    assert_same_as_transformers(ours, transformers_tokenizer(model_dir))


def test_a_torn_cache_file_is_rebuilt(tiny_llama_dir, tokenizer_cache):
    Tokenizer(tiny_llama_dir)
    (entry,) = tokenizer_cache.iterdir()
    entry.write_text('{"backend": "not a tokenizer"')

    assert backend_cache.load(tiny_llama_dir) is None
    rebuilt = Tokenizer(tiny_llama_dir)

    assert rebuilt.encode("Hello world") == Tokenizer(tiny_llama_dir).encode("Hello world")
    assert backend_cache.load(tiny_llama_dir) is not None


def test_a_worker_with_a_warm_cache_never_imports_transformers(tiny_llama_dir, tokenizer_cache):
    Tokenizer(tiny_llama_dir)
    probe = (
        "import sys\n"
        "import decode_worker.worker, prefill_worker.worker\n"
        "from engine.config import EngineConfig\n"
        "from engine.llm_engine import LLMEngine\n"
        f"engine = LLMEngine(EngineConfig(model={str(tiny_llama_dir)!r}, dtype='float32',"
        " block_size=8, num_kv_blocks=16, num_threads=1))\n"
        "print(engine.tokenizer.decode(engine.tokenizer.encode('Hello world')))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    env = dict(os.environ, PDSERVE_TOKENIZER_CACHE=str(tokenizer_cache))
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )

    assert done.returncode == 0, done.stderr
    decoded, imported = done.stdout.strip().splitlines()[-2:]
    assert decoded == "Hello world"
    assert imported == "[]"


DIGITS_AND_NON_ASCII = "Order 12345 costs 678.90 € in 2024 — Grüße aus Köln, 東京は晴れ 🙂"


def _digit_merging_tokenizer(eos: str):
    """A byte-level BPE whose merges join digits: a family class that splits digits
    one by one (Qwen2's) tokenizes it differently from its tokenizer.json."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=[eos, "<unk>", "<pad>", "<bos>"],  # what GemmaTokenizer looks up
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["Order 12345 costs 678.90 and 2024 items " * 20, "Grüße aus Köln 東京は晴れ " * 5]
    rust.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=eos)


def _family_dir(root, family: str, tokenizer_class: str | None):
    """A model directory of `family` (config.json only) with the digit-merging
    tokenizer, its tokenizer_config naming `tokenizer_class` (None: as saved, i.e.
    `TokenizersBackend`, what transformers 5 writes for a plain tokenizer.json)."""
    from tests.factories import tiny_config

    directory = root / f"{family}-{tokenizer_class or 'backend'}"
    directory.mkdir()
    tiny_config(family).save_pretrained(directory)
    _digit_merging_tokenizer("<|endoftext|>").save_pretrained(directory)
    settings_file = directory / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    assert settings["tokenizer_class"] == "TokenizersBackend"
    if tokenizer_class is not None:
        settings["tokenizer_class"] = tokenizer_class
        settings_file.write_text(json.dumps(settings))
    return directory


HUB_TOKENIZER_CLASS = {
    "llama": "PreTrainedTokenizerFast",
    "mistral": "LlamaTokenizer",
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3": "GemmaTokenizer",
    "phi3": "LlamaTokenizer",
    "mixtral": "LlamaTokenizer",
}
"""What each family's published checkpoints name in tokenizer_config.json."""


@pytest.mark.parametrize("family", sorted(HUB_TOKENIZER_CLASS))
@pytest.mark.parametrize("written_as", ["backend", "family class"])
def test_tokens_are_autotokenizers_for_each_family_and_way_of_writing(
    tmp_path, tokenizer_cache, family, written_as
):
    from transformers import AutoTokenizer

    tokenizer_class = None if written_as == "backend" else HUB_TOKENIZER_CLASS[family]
    model_dir = _family_dir(tmp_path, family, tokenizer_class)
    reference = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    expected = reference.encode(DIGITS_AND_NON_ASCII)

    built = Tokenizer(model_dir)
    cached = Tokenizer(model_dir)

    assert "hf" not in vars(cached)
    assert built.encode(DIGITS_AND_NON_ASCII) == expected
    assert cached.encode(DIGITS_AND_NON_ASCII) == expected
    assert cached.decode(expected) == reference.decode(expected, skip_special_tokens=True)


def test_qwen2_splits_digits_where_its_tokenizer_json_would_not(tmp_path, tokenizer_cache):
    """The case that broke: a Qwen2 directory whose tokenizer_config names
    `TokenizersBackend` is tokenized by Qwen2Tokenizer (digits one by one), not
    straight from tokenizer.json."""
    from tokenizers import Tokenizer as RustTokenizer

    model_dir = _family_dir(tmp_path, "qwen2", None)
    from_file = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
    ours = Tokenizer(model_dir).encode(DIGITS_AND_NON_ASCII)

    assert len(ours) > len(from_file.encode(DIGITS_AND_NON_ASCII).ids)
    tokenizer = Tokenizer(model_dir)
    assert tokenizer.decode(ours) == DIGITS_AND_NON_ASCII
    texts = [tokenizer.token_text(t) for t in ours]
    assert all(len(t.strip()) <= 1 for t in texts if any(c.isdigit() for c in t))


def test_a_changed_config_json_is_a_new_cache_entry(tiny_model_dirs, tmp_path, tokenizer_cache):
    """config.json's model_type picks AutoTokenizer's class: it is part of the key."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    Tokenizer(model_dir)
    config_file = model_dir / "config.json"
    config_file.write_text(config_file.read_text().replace('"llama"', '"qwen2"'))

    Tokenizer(model_dir)

    assert len(list(tokenizer_cache.iterdir())) == 2
