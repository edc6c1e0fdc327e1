"""Tokenizer and chat template of a local model directory (never the network).

Encoding and decoding go straight to the `tokenizers` (Rust) object that transformers
wraps; transformers itself is imported only for what needs it (chat templates,
grammar vocabularies), because its import is about a second of every worker's start
and a worker only ever decodes. The effective Rust tokenizer, as transformers builds
it from the model's files with AutoTokenizer, is cached on disk (`backend_cache`), so a
worker that finds it there never imports transformers at all.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from engine import backend_cache

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer


class Tokenizer:
    """Wraps a model directory's tokenizer with the few calls the server needs."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        state = backend_cache.load(self.model_dir) or backend_cache.store(self.model_dir, self.hf)
        self._backend: BackendTokenizer | None = state.backend
        self._decode_needs_hf = not state.decode_is_backend
        self.eos_token_ids = frozenset(self._eos_ids(state.eos_token_id))

    @cached_property
    def hf(self):
        """The transformers tokenizer: built on first use (chat templates, llguidance)."""
        return _load_hf_tokenizer(self.model_dir)

    def prepare_chat_template(self) -> None:
        """Build transformers' tokenizer now. The driver calls this at start, since it
        renders every chat request's template and the first should not pay the import."""
        _ = self.hf

    def _eos_ids(self, eos_token_id: int | None) -> set[int]:
        ids: set[int] = set() if eos_token_id is None else {int(eos_token_id)}
        generation_config = self.model_dir / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    @property
    def vocab_size(self) -> int:
        if self._backend is None:
            return len(self.hf)
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, add_special_tokens=add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is None:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **options,
    ) -> list[int]:
        """Prompt token ids for a chat, with the assistant turn opened unless told not to;
        `tools` (OpenAI function definitions) are passed to the template, which may
        render them; `options`: transformers' `continue_final_message` and the
        template's own variables."""
        text = self.hf.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **options,
        )
        return self._encode(text, add_special_tokens=False)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template reads `tools` at all (many small models' do not)."""
        template = self.hf.chat_template
        texts = template.values() if isinstance(template, dict) else [template or ""]
        return any("tools" in text for text in texts)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs name tokens by it)."""
        return self._decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self._decode_needs_hf:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _load_hf_tokenizer(model_dir: Path):
    """What transformers' AutoTokenizer builds for the directory, always: it picks the
    class from config.json's model_type as well as tokenizer_config.json, and a
    family's class may rebuild the pre-tokenizer rather than take tokenizer.json's
    (Qwen2Tokenizer splits digits one by one even where the file says
    `TokenizersBackend`). Its start-up cost is paid once per directory: the Rust object
    it built is cached (`backend_cache`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
