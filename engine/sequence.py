"""A request's state inside one engine: tokens, KV blocks, progress, stop conditions.

Who owns a sequence's blocks is named by its status:

    WAITING    queued for compute (a fresh prompt, a preempted or recomputed one); may
               already hold blocks (a failed import recomputes into its reserved ones)
    IMPORTING  its KV is coming from a peer: first it waits for blocks, then a transfer
               writes into them. An abort while bytes are landing only marks it; the
               blocks are freed when the transfer stops writing (`finish_import`).
    READY      its KV is in the pool (imported); waiting for a seat in the decode batch
    RUNNING    in the batch: prefilling in chunks or decoding one token per step
    PREFILLED  prompt done and first token sampled on a prefill worker; the blocks wait
               for `export_prefilled`, which hands them to the KV sender's lease
    FINISHED   stopped, aborted or handed off; holds no blocks

With prefix caching, a sequence's leading full blocks may be shared with other
sequences and export leases (read-only; each holder owns one reference), and they stay
cached after it is gone (engine/block_manager.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine import clock
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.logprobs import PromptLogprobs, TokenLogprobs
    from engine.shaping_state import TokenCounts
    from engine.structured import Guide


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    IMPORTING = 1
    READY = 2
    RUNNING = 3
    PREFILLED = 4
    FINISHED = 5
    HELD = 6
    """Out of every batch while its reader is behind (`Sequence.reader_behind`)."""


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in this engine's pool."""
    block_hashes: list[int] = field(default_factory=list)
    """Prefix-cache names of its leading full blocks, grown as needed (engine/prefix_cache.py)."""
    num_published: int = 0
    """Leading blocks of `block_ids` already offered to the prefix cache (their KV complete)."""
    num_freed_blocks: int = 0
    """Leading blocks of `block_ids` given back because no sliding window reaches them
    (placeholders now: engine/sliding_window.py)."""
    num_cached_tokens: int = 0
    """Tokens whose KV this engine's prefix cache already held when the sequence was first
    admitted (a fresh prompt: not computed; an import: not moved)."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_after_prefill: bool = False
    """Prefill workers set this: the sequence leaves the engine after its first token."""
    import_tokens: int = 0
    """IMPORTING: tokens of KV the peer sends (the prompt)."""
    abort_requested: bool = False
    """IMPORTING with bytes landing: aborted, freed once the transfer stops writing."""
    reader_behind: bool = False
    """Whoever reads this sequence's tokens has not kept up (a slow streaming client):
    the scheduler holds it out of every batch until the reader catches up, so a slow
    reader slows its own stream and no queue of its tokens grows anywhere."""
    arrival_time: float = field(default_factory=clock.now)
    priority: float | None = None
    """Where the request stands in line: the time it reached the cluster, on the driver's
    clock (None: its arrival here). Seats go to imported sequences in this order, not
    in the order their transfers happened to land, so two near-simultaneous arrivals
    always make the same batches; the youngest by it is preempted first."""
    first_scheduled_at: float | None = None
    """Monotonic time the scheduler first gave this sequence compute (queue wait ends)."""
    first_token_at: float | None = None
    """Monotonic time its first token in this engine was sampled."""
    detokenizer: IncrementalDetokenizer | None = None
    output_text: str = ""
    emitted_text_len: int = 0
    guide: Guide | None = None
    """Its grammar state in this engine (structured output), rebuilt from the decided
    tokens wherever the sequence is created (engine/structured.py)."""
    prompt_logprobs: PromptLogprobs | None = None
    """Prompt logprobs being computed here (`echo`), sent with the first token."""
    token_counts: TokenCounts | None = None
    """A penalized sequence's output counts in this engine, counted as its tokens are
    decided; from its whole history at its first step here (engine/shaping_state.py)."""

    @property
    def order(self) -> float:
        return self.arrival_time if self.priority is None else self.priority

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
        if start >= prompt_len:  # a decode step's token: no copy of the whole history
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(frozen=True)
class TokenDelta:
    """The tokens one engine step added to one request's output: the one token record.
    The engine makes it once (as a `SequenceOutput`); the decode worker streams it as it
    is (its `TokenEvent`), the prefill worker answers with it (`PrefillResult.first`),
    and the cluster hands it to its callers inside a `GenerationChunk`. Nothing copies
    it field by field."""

    token_ids: list[int]
    text: str
    """Their text, as safe to stream (a possible stop-string prefix held back)."""
    finished: bool
    finish_reason: str | None
    num_output_tokens: int
    """Output tokens of the request so far, these included."""
    num_cached_tokens: int = 0
    """`Sequence.num_cached_tokens`: KV this engine's prefix cache held at admission."""
    logprobs: list[TokenLogprobs] | None = None
    """Logprobs of `token_ids`, when the request asked for them."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With the first token of a request that asked (`echo`): one entry per prompt token."""


@dataclass(frozen=True, kw_only=True)
class SequenceOutput(TokenDelta):
    """What one step produced for one request: its token record, and whose it is. The
    caller streams it on as the record it is."""

    request_id: str
    num_prompt_tokens: int
    prefilled: bool = False
    """True when a `stop_after_prefill` sequence is ready for KV export."""
