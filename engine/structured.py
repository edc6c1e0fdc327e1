"""Structured output: a grammar per request that masks the tokens it cannot take.

Lifecycle of a constrained request:
    the frontend turns `response_format`, `guided_*` or a forced tool choice into a
    `StructuredSpec` and checks it (`check_spec`: a bad schema is a 400 before any
    worker sees it)
    -> every engine that holds the request (the prefill worker, the decode worker, the
       next decode worker after a migration) compiles its own `Guide` when the sequence
       is created, and replays the tokens already decided elsewhere, so its state is
       exactly that of the decided text
    -> each step the sampler asks the guide for its row's allowed-token bitmask and
       sets every other logit to -inf, before penalties, temperature and logprobs
    -> the sampled token is accepted; when the grammar can take nothing more (`done`)
       the request finishes with "stop".

The grammar engine is llguidance: measured by `python -m bench.structured_bench`, its
tokenizer set-up and grammar compile are far cheaper
than xgrammar's and a mask costs about the same; it needs no torch kernel of its own.
The tokenizer view it needs (~1 s to build at a 49k vocabulary) is built once per
engine, at the first constrained request.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredSpec

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)
_JSON_STYLE = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "lenient": True,
}
"""JSON as `json.dumps` writes it: a model cannot spend its tokens on whitespace, and
keywords llguidance does not implement (e.g. `format`) are ignored, not refused."""


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of a spec; raises ValueError for a malformed one."""
    from llguidance import LLMatcher

    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_STYLE)
    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.value, defaults=_JSON_STYLE)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.value)
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def check_spec(spec: StructuredSpec) -> None:
    """Raise ValueError (with llguidance's reason) when the grammar cannot be built.
    Called by the frontend while parsing, without a tokenizer."""
    from llguidance import LLMatcher

    try:
        text = grammar_text(spec)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid {spec.kind}: {exc}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise ValueError(f"invalid {spec.kind}: {messages[0] if messages else 'rejected'}")


class GrammarCompiler:
    """One per engine: the llguidance view of its tokenizer, built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        """Width of the model's logits (may exceed the tokenizer's vocabulary)."""
        self._ll_tokenizer = None

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _view(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            eos = sorted(self.tokenizer.eos_token_ids) or None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer.hf, n_vocab=self.vocab_size, eos_token=eos
            )
        return self._ll_tokenizer

    def guide(self, request_id: str, spec: StructuredSpec, decided: list[int]) -> Guide:
        """A fresh guide for a request, advanced over the tokens already decided."""
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self._view(), grammar_text(spec), log_level=0)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {spec.kind}: {exc}", request_id) from None
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {spec.kind}: {matcher.get_error()}", request_id)
        guide = Guide(request_id, matcher)
        for token_id in decided:
            if not guide.accept(token_id):
                raise InvalidRequestError(
                    f"decided token {token_id} does not follow the {spec.kind}", request_id
                )
        return guide


class Guide:
    """One request's grammar state in one engine; used on the engine thread only."""

    def __init__(self, request_id: str, matcher):
        self.request_id = request_id
        self.matcher = matcher

    def fill(self, bitmask_row: torch.Tensor) -> None:
        """Write the allowed next tokens into one contiguous int32 row of a bitmask."""
        self.matcher.unsafe_compute_mask_ptr(
            bitmask_row.data_ptr(), bitmask_row.numel() * bitmask_row.element_size()
        )

    def accept(self, token_id: int) -> bool:
        """Advance over a decided token; False (and the guide `done`) when the grammar
        cannot take it, which the mask makes impossible for sampled tokens."""
        if self.matcher.consume_token(token_id):
            return True
        logger.warning(
            "[request %s] token %s breaks the grammar: %s",
            self.request_id,
            token_id,
            self.matcher.get_error(),
        )
        return False

    @property
    def done(self) -> bool:
        """The grammar is complete (or broken) and can take no further token."""
        return self.matcher.is_stopped()


def fill_bitmask(guides: list[Guide], words: int) -> torch.Tensor:
    """[len(guides), words] int32: bit t of a row allows token t."""
    bitmask = torch.empty(len(guides), words, dtype=torch.int32)
    for row, guide in enumerate(guides):
        guide.fill(bitmask[row])
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every logit whose bit is 0 to -inf, in place; logits [rows, vocab]."""
    vocab = logits.shape[-1]
    bits = (bitmask.to(logits.device)[:, :, None] >> _BITS.to(logits.device)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
