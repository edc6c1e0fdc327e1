"""One engine = one model + one KV pool + one scheduler, stepped by its owner.

Lifecycle of a request through `LLMEngine`:
    add_request -> waiting -> scheduled in prefill pieces -> first token sampled
    -> (prefill worker: leaves with its blocks for export | otherwise: decode steps)
    -> stop condition -> finished, blocks back to the pool.
A decode worker adds requests whose KV it imported with `add_prefilled`, which
skips straight to decode. Workers and the CLI drive `step()` in their own loops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockAllocator, blocks_needed
from engine.config import EngineConfig
from engine.demo_model import resolve_model
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.kv_cache import KVCachePool, KVLayout
from engine.model import LlamaForward
from engine.model_runner import ModelRunner
from engine.model_spec import load_model_spec
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceOutput, SequenceStatus
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Plain counters a worker reports; the metrics layer turns them into Prometheus."""

    num_waiting: int
    num_running: int
    free_blocks: int
    total_blocks: int
    num_preemptions: int
    prefill_batch_sizes: dict[int, int] = field(default_factory=dict)
    """Steps so far by how many sequences prefilled in them (batch size -> steps)."""
    decode_batch_sizes: dict[int, int] = field(default_factory=dict)
    """Steps so far by how many sequences decoded one token in them."""


class LLMEngine:
    """Synchronous engine; not thread-safe: one owner calls add/abort/step."""

    def __init__(self, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir, self.model_id = resolve_model(config.model)
        self.spec = load_model_spec(self.model_dir, self.model_id)
        self.max_model_len = min(
            config.max_model_len or self.spec.context_window, self.spec.context_window
        )
        self.model = LlamaForward(
            self.model_dir,
            self.spec,
            config.torch_dtype,
            config.device,
            max_positions=self.max_model_len,
        )
        self.layout = KVLayout.for_model(self.spec, config.torch_dtype, config.block_size)
        self.kv_pool = KVCachePool(self.layout, config.num_kv_blocks, config.device)
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.scheduler = Scheduler(config, self.allocator)
        self.runner = ModelRunner(self.model, self.kv_pool)
        self.sampler = Sampler()
        self.tokenizer = Tokenizer(self.model_dir)
        self.sequences: dict[str, Sequence] = {}
        self.prefill_batch_sizes: dict[int, int] = {}
        self.decode_batch_sizes: dict[int, int] = {}

    # --- requests -----------------------------------------------------------------

    def validate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Raise InvalidRequestError for what this engine can never serve."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", request_id)
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens including at least one output token",
                request_id,
            )
        if (
            blocks_needed(len(prompt_token_ids) + 1, self.config.block_size)
            > self.config.num_kv_blocks
        ):
            raise InvalidRequestError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the KV pool "
                f"({self.config.num_kv_blocks} blocks of {self.config.block_size})",
                request_id,
            )
        if request_id in self.sequences:
            raise InvalidRequestError("duplicate request id", request_id)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_after_prefill: bool = False,
        output_token_ids: list[int] | None = None,
        emitted_text_len: int | None = None,
    ) -> Sequence:
        """Queue a request. `output_token_ids` resumes one whose tokens were already decided
        elsewhere; `emitted_text_len` says how much of their text the client already has."""
        self.validate(request_id, prompt_token_ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            output_token_ids=list(output_token_ids or []),
            stop_after_prefill=stop_after_prefill,
        )
        self._replay_text(seq, emitted_text_len)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def reserve_blocks(self, num_tokens: int, request_id: str) -> list[int] | None:
        """Blocks for an incoming KV import of `num_tokens`, or None when the pool is short."""
        needed = blocks_needed(num_tokens, self.config.block_size)
        if not self.allocator.can_allocate(needed):
            return None
        return self.allocator.allocate(needed, request_id)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.allocator.free(block_ids)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        block_ids: list[int],
        emitted_text_len: int | None = None,
    ) -> Sequence:
        """Join the decode batch with KV already imported into `block_ids` (covering the prompt)."""
        self.validate(request_id, prompt_token_ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            output_token_ids=list(output_token_ids),
            block_ids=list(block_ids),
            num_computed_tokens=len(prompt_token_ids),
        )
        self._replay_text(seq, emitted_text_len)
        self.sequences[request_id] = seq
        self.scheduler.add_running(seq)
        return seq

    def _replay_text(self, seq: Sequence, emitted_text_len: int | None) -> None:
        """Rebuild the text of tokens decided elsewhere, so that text held back there (a
        partial UTF-8 character, a possible stop string) is still streamed from here."""
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        for token_id in seq.output_token_ids:
            seq.output_text += seq.detokenizer.push(token_id)
        known = len(seq.output_text) if emitted_text_len is None else emitted_text_len
        seq.emitted_text_len = min(known, len(seq.output_text))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks return to the pool. Idempotent."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, release_blocks=seq.status != SequenceStatus.PREFILLED)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return True

    def take_prefilled(self, request_id: str) -> Sequence:
        """Hand a PREFILLED sequence (and ownership of its blocks) to the caller."""
        seq = self.sequences.pop(request_id)
        assert seq.status == SequenceStatus.PREFILLED, seq.status
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            free_blocks=self.allocator.num_free,
            total_blocks=self.allocator.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefill_batch_sizes=dict(self.prefill_batch_sizes),
            decode_batch_sizes=dict(self.decode_batch_sizes),
        )

    # --- stepping -----------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        """Run one forward pass over what the scheduler picks; return per-request news."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self._count_batch(chunks)
        result = self.runner.run(chunks)
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
        seqs = result.sampling_seqs
        if not seqs:
            return []
        tokens = self.sampler.sample(
            result.logits, [s.params for s in seqs], [len(s.output_token_ids) for s in seqs]
        )
        return [self._append_token(seq, token) for seq, token in zip(seqs, tokens, strict=True)]

    def _count_batch(self, chunks: list) -> None:
        # Exact sizes, not buckets: at most max_num_seqs keys, and metrics picks the buckets.
        decode = sum(
            1
            for c in chunks
            if c.seq.output_token_ids
            and c.num_new_tokens == 1
            and c.seq.num_computed_tokens == c.seq.num_tokens - 1
        )
        for sizes, size in (
            (self.decode_batch_sizes, decode),
            (self.prefill_batch_sizes, len(chunks) - decode),
        ):
            if size:
                sizes[size] = sizes.get(size, 0) + 1

    def _append_token(self, seq: Sequence, token_id: int) -> SequenceOutput:
        seq.output_token_ids.append(token_id)
        seq.output_text += seq.detokenizer.push(token_id)
        reason = self._finish_reason(seq, token_id)
        prefilled = False
        if reason is not None and not seq.params.stop:
            seq.output_text += seq.detokenizer.flush()
        if reason is not None:
            self._finish(seq, reason)
        elif seq.stop_after_prefill:
            prefilled = True
            self.scheduler.finish(seq, release_blocks=False)
            seq.status = SequenceStatus.PREFILLED
        return SequenceOutput(
            request_id=seq.request_id,
            new_token_ids=[token_id],
            new_text=self._emit_text(seq),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            prefilled=prefilled,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        self.sequences.pop(seq.request_id, None)

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return "stop"
        if params.stop and _truncate_at_stop(seq):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _emit_text(seq: Sequence) -> str:
        """New text safe to stream: while running, hold back a possible stop-string prefix."""
        end = len(seq.output_text)
        if not seq.is_finished and seq.params.stop:
            end = max(seq.emitted_text_len, end - max(len(s) for s in seq.params.stop) + 1)
        delta = seq.output_text[seq.emitted_text_len : end]
        seq.emitted_text_len = end
        return delta

    # --- convenience --------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Sequence]:
        """Run prompts to completion; returns finished sequences in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [
            self.add_request(f"gen-{i}-{id(prompts)}", prompt, p)
            for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True))
        ]
        while self.has_unfinished():
            self.step()
        return seqs


def _truncate_at_stop(seq: Sequence) -> bool:
    """Cut output_text before the earliest stop string; True when one was found."""
    window_start = max(0, seq.emitted_text_len - max(len(s) for s in seq.params.stop))
    hits = [(seq.output_text.find(s, window_start), s) for s in seq.params.stop]
    hits = [(pos, s) for pos, s in hits if pos >= 0]
    if not hits:
        return False
    pos, stop = min(hits)
    keep = pos + len(stop) if seq.params.include_stop_str_in_output else pos
    seq.output_text = seq.output_text[:keep]
    return True
