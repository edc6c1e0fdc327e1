"""The effective Rust tokenizer of a model directory, cached on disk.

transformers builds its fast tokenizer from the model's files and then adjusts the
underlying `tokenizers` object (added and special tokens, the post-processor that
adds BOS/EOS). `Tokenizer` encodes and decodes with that object directly; this module
saves it once, keyed by the tokenizer files and both libraries' versions, so a worker
process that starts later loads it in milliseconds instead of importing transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

from engine.envs import tokenizer_cache_dir

_TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""Every file transformers may build a tokenizer from, all of them in the key; config.json
too, since its model_type picks AutoTokenizer's class."""


@dataclass(frozen=True)
class BackendState:
    """What `Tokenizer` needs besides transformers.

    `backend` is None when transformers has no Rust tokenizer for the model (a slow,
    Python-only one): then every call goes through transformers. `decode_is_backend`
    is False when transformers post-processes decoded text (`clean_up_tokenization_spaces`),
    so decoding must go through it to stay identical."""

    backend: BackendTokenizer | None
    eos_token_id: int | None
    decode_is_backend: bool


def cache_key(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for library in ("transformers", "tokenizers"):
        digest.update(f"{library}={version(library)};".encode())
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(f"{name}:".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


def load(model_dir: Path) -> BackendState | None:
    """The cached state for `model_dir`, or None when nothing (valid) is cached."""
    path = tokenizer_cache_dir() / f"{cache_key(model_dir)}.json"
    try:
        saved = json.loads(path.read_text())
        backend = BackendTokenizer.from_str(saved["backend"])
    except Exception:  # missing, torn or from elsewhere (tokenizers raises plain Exception)
        return None
    _as_transformers_calls_it(backend, saved["split_special_tokens"])
    return BackendState(backend, saved["eos_token_id"], decode_is_backend=True)


def store(model_dir: Path, hf) -> BackendState:
    """The state of the transformers tokenizer `hf`, saved for the next process when
    its Rust object fully stands for it (a cache that cannot be written is skipped)."""
    backend = getattr(hf, "backend_tokenizer", None)
    # A copy: transformers changes its own object's settings on every call.
    serialized = None if backend is None else backend.to_str()
    state = BackendState(
        backend=None if serialized is None else BackendTokenizer.from_str(serialized),
        eos_token_id=hf.eos_token_id,
        decode_is_backend=backend is not None and not hf.clean_up_tokenization_spaces,
    )
    if state.backend is None:
        return state
    split_special_tokens = bool(getattr(hf, "split_special_tokens", False))
    _as_transformers_calls_it(state.backend, split_special_tokens)
    if state.decode_is_backend:
        saved = {
            "backend": serialized,
            "eos_token_id": hf.eos_token_id,
            "split_special_tokens": split_special_tokens,
        }
        _write_atomically(tokenizer_cache_dir() / f"{cache_key(model_dir)}.json", saved)
    return state


def _as_transformers_calls_it(backend: BackendTokenizer, split_special_tokens: bool) -> None:
    """transformers sets these on every encode call; a saved object may carry others."""
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = split_special_tokens


def _write_atomically(path: Path, saved: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
            json.dump(saved, tmp)
        os.replace(tmp.name, path)
    except OSError:
        pass
