"""Incremental detokenization: text deltas that are correct at every step.

Decoding one token at a time breaks on two things: byte-level tokens that carry
only part of a multi-byte UTF-8 character, and tokenizers that drop a token's
leading space when it is decoded alone. So each step decodes a small window of
recent tokens twice (with and without the newest ones) and emits the difference,
holding text back while it ends in an incomplete character.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One per request; `push` is called with each new token id, in order."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back, even an incomplete character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
