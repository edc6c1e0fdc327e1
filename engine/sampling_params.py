"""Per-request sampling parameters, validated on construction.

The semantics follow vLLM's, so a client written against it gets the same tokens for
the same logits: logit_bias, then the minimum-length ban on stop tokens, then the
grammar's mask, then the penalties (repetition over prompt and output, frequency and
presence over the output), then temperature; logprobs are taken there, before
top-k/top-p truncation; then top-k, top-p and the draw (engine/sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

MAX_TOKENS_LIMIT = 1 << 20
MAX_LOGPROBS = 20
"""Most alternatives a request may ask per position (OpenAI's own limit)."""
MAX_CACHE_SALT_CHARS = 1024

T = TypeVar("T")
StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]


@dataclass(frozen=True)
class StructuredSpec:
    """A grammar the output must follow (engine/structured.py compiles it)."""

    kind: StructuredKind
    value: str = ""
    """JSON schema text, a regex, a JSON list of choice strings, or a Lark grammar."""

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "regex", "choice", "lark"):
            raise ValueError(f"unknown structured output kind {self.kind!r}")
        if self.kind != "json_object" and not self.value:
            raise ValueError(f"structured output of kind {self.kind} needs a value")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    """Tokens less likely than min_p x the likeliest one (after temperature) are not drawn;
    applied before top-k and top-p, as vLLM does (0 disables)."""
    seed: int | None = None
    """Each output position draws from its own generator seeded by (seed, position): the
    same request in the same batch gives the same output, and a migrated stream continues
    from the same generators. With `deterministic` on, the logits are the same bits in
    any batch and after a migration too, so the output is."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first match."""
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the output text; stop strings are
    matched in the text as it is streamed."""
    min_tokens: int = 0
    """Until this many tokens are out, EOS and `stop_token_ids` cannot be sampled and
    stop strings are not looked for."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of the token in the output."""
    repetition_penalty: float = 1.0
    """Tokens seen in prompt or output: positive logits divided by it, negative ones
    multiplied (1 disables)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias added to its logit), applied first."""
    logprobs: int | None = None
    """Per output token: its logprob, plus this many most likely alternatives (None: off)."""
    prompt_logprobs: int | None = None
    """Per prompt token after the first: its logprob plus this many alternatives (None: off)."""
    structured: StructuredSpec | None = None
    """A grammar the output must follow."""
    cache_salt: str | None = None
    """Not a sampling choice but the request's prefix-cache scope (vLLM's `cache_salt`):
    blocks are shared only between requests with the same salt, so one tenant cannot
    time another's prompts through cache hits. None: the shared cache."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(
                f"max_tokens must be an integer in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens!r}"
            )
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k must be a non-negative integer (0 disables), got {self.top_k!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stops)
        self._check_penalties()
        self._check_logprobs()
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str)
            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
            )
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)

    def _check_penalties(self) -> None:
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < float(self.repetition_penalty) <= 100.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}"
            )

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def derived(self, key: Hashable, build: Callable[[], T]) -> T:
        """What `build()` makes of these params, made once per `key` and kept with them.
        The sampler keeps the tensors it derives from the bias and stop ids here
        (engine/shaping_state.py), so every sequence sharing this object shares them and
        no step rebuilds them. Kept out of equality, `dataclasses.replace` and pickles."""
        cache = self.__dict__.setdefault("_derived", {})
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_derived", None)
        return state

    def shapes_logits(self, num_output_tokens: int) -> bool:
        """Whether anything changes this row's logits before the draw at this position
        (rows that answer False keep the plain argmax / softmax path)."""
        return bool(
            self.logit_bias
            or self.penalized
            or self.structured is not None
            or num_output_tokens < self.min_tokens
        )
