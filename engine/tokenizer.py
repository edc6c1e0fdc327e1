"""Tokenizer and chat template of a local model directory (never the network)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

_BACKEND_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
"""tokenizer_config.json classes that are a plain tokenizer.json: AutoTokenizer would
build the same object, but only after importing the model's config class (a second of
every worker's start)."""


class Tokenizer:
    """Wraps a HF tokenizer with the few calls the server needs."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.hf = _load_hf_tokenizer(self.model_dir)
        self.eos_token_ids = frozenset(self._eos_ids())

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        generation_config = self.model_dir / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        """Prompt token ids for a chat, with the assistant turn opened; `tools` (OpenAI
        function definitions) are passed to the template, which may render them."""
        text = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return list(self.hf.encode(text, add_special_tokens=False))

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template reads `tools` at all (many small models' do not)."""
        template = self.hf.chat_template
        texts = template.values() if isinstance(template, dict) else [template or ""]
        return any("tools" in text for text in texts)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs name tokens by it)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)


def _load_hf_tokenizer(model_dir: Path):
    settings_file = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    plain = settings.get("tokenizer_class") in _BACKEND_CLASSES
    if plain and (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
