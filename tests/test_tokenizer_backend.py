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
