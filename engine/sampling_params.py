"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOKENS_LIMIT = 1 << 20


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
    seed: int | None = None
    """Same seed, same output; also continues deterministically after a migration."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first match."""
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
