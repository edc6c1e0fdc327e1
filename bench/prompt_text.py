"""Prompts of an exact token count, through the served model's own tokenizer.

Workloads ask for "a prompt of N tokens" as the server will count it: for completions
the text encoded with the tokenizer's special tokens, for chat the whole templated
conversation. Text is built from whole-word vocabulary entries (" cat", " river")
that encode back to themselves, so N words are N tokens; what a chat template or a
BOS token adds is measured and subtracted, and a few correction rounds absorb merges
at the edges. Everything here runs before the measured interval, never during it.
"""

from __future__ import annotations

import random
import re
from functools import cached_property

_WORD = re.compile(r"^ ?[a-z]{2,}$")


class PromptMaker:
    """One per benchmark run; wraps `engine.tokenizer.Tokenizer` of `--tokenizer`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.hf = tokenizer.hf

    @classmethod
    def from_arg(cls, tokenizer_arg: str) -> PromptMaker:
        """`demo` or a local directory with a HF tokenizer (never the network)."""
        from engine.demo_model import resolve_model
        from engine.tokenizer import Tokenizer

        directory = resolve_model("demo")[0] if tokenizer_arg == "demo" else tokenizer_arg
        return cls(Tokenizer(directory))

    @cached_property
    def words(self) -> list[str]:
        """Vocabulary entries that are one lowercase word and encode back to one token.

        Byte-level BPE vocabularies hold words with their leading space (" river"), which
        concatenate into exactly one token each; others get bare words joined by spaces.
        """
        spaced, bare = [], []
        for token_id in range(len(self.hf)):
            text = self.hf.decode([token_id])
            if _WORD.match(text) and self.hf.encode(text, add_special_tokens=False) == [token_id]:
                (spaced if text.startswith(" ") else bare).append(text)
        if not spaced and not bare:
            raise ValueError("the tokenizer has no whole-word tokens to build prompts from")
        return spaced or bare

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def count_completion(self, prompt: str | list[int]) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self.tokenizer.encode(prompt))

    def count_chat(self, messages: list[dict]) -> int:
        return len(self.tokenizer.apply_chat_template(messages))

    def chat_text(self, messages: list[dict]) -> str:
        """The templated conversation as text, for sending a chat to a completions endpoint."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def word_text(self, count: int, rng: random.Random) -> str:
        """`count` random words; exactly `count` tokens for byte-level BPE vocabularies."""
        picked = [rng.choice(self.words) for _ in range(count)]
        spaced = self.words[0].startswith(" ")
        return "".join(picked) if spaced else " ".join(picked)

    def fit(self, target: int, rng: random.Random, measure) -> tuple[str, int]:
        """Text whose `measure(text)` token count is `target` (or the nearest reached).

        `measure` counts what the server will see (the text alone, or the text inside
        a template); the text grows or shrinks a word at a time around the template's
        own cost until the count matches.
        """
        overhead = measure("")
        pool = [rng.choice(self.words) for _ in range(target + 64)]
        spaced = pool[0].startswith(" ")
        count = max(1, target - overhead)
        best = ("", overhead)
        for _ in range(8):
            words = pool[:count] if count <= len(pool) else pool + pool[: count - len(pool)]
            text = "".join(words) if spaced else " ".join(words)
            actual = measure(text)
            if abs(actual - target) < abs(best[1] - target):
                best = (text, actual)
            if actual == target:
                break
            count = max(1, count + target - actual)
        return best

    def completion_prompt(self, target: int, rng: random.Random) -> tuple[str, int]:
        return self.fit(target, rng, self.count_completion)

    def chat_user(self, target: int, rng: random.Random, system: str | None = None):
        """A user message sized so the templated chat (with `system`) has `target` tokens."""

        def measure(text: str) -> int:
            return self.count_chat(chat_messages(text, system))

        return self.fit(target, rng, measure)

    def random_ids(self, target: int, rng: random.Random) -> list[int]:
        """Token-id prompts: exact by construction, skipping the vocabulary's edges."""
        low, high = min(100, self.vocab_size // 4), max(self.vocab_size - 100, self.vocab_size // 2)
        return [rng.randrange(low, high) for _ in range(target)]


def chat_messages(user: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": user}]
