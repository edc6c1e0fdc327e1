"""A request's state inside one engine: tokens, KV blocks, progress, stop conditions."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREFILLED = 2
    """Prompt done and first token sampled; blocks kept for a KV export."""
    FINISHED = 3


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in this engine's pool."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_after_prefill: bool = False
    """Prefill workers set this: the sequence leaves the engine after its first token."""
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_at: float | None = None
    """Wall-clock time the scheduler first gave this sequence compute (queue wait ends)."""
    detokenizer: IncrementalDetokenizer | None = None
    output_text: str = ""
    emitted_text_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass
class SequenceOutput:
    """What one step produced for one request; the caller streams it on."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    prefilled: bool = False
    """True when a `stop_after_prefill` sequence is ready for KV export."""
