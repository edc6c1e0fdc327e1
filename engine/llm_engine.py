"""One engine = one model + one KV pool + one scheduler, stepped by its owner.

Lifecycle of a request through `LLMEngine` (see `engine.sequence` for who owns the
blocks in each state):
    add_request -> WAITING -> RUNNING in prefill pieces -> first token sampled
    -> prefill worker: PREFILLED -> export_prefilled hands the blocks to a KV lease
    -> otherwise: decode steps -> stop condition -> FINISHED, blocks back to the pool.
A decode worker that receives a prompt's KV from a peer calls begin_import
(IMPORTING, waiting for blocks) -> reserve_imports gives it blocks -> the transfer
writes them -> finish_import -> READY -> RUNNING, decoding from the first token.
`abort` ends a request in any state; every exit goes through `_drop`. Workers and
the CLI drive `step()` in their own loops.

Prefix caching (`prefix_caching`, engine/prefix_cache.py): after every step, and when
an import lands, the blocks whose KV just became complete are published; the
scheduler lets later sequences start from them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from engine import clock, envs
from engine.block_manager import BlockAllocator, blocks_needed, held_blocks
from engine.config import AttentionBackendName as AttentionChoice
from engine.config import EngineConfig
from engine.config import Kernels as KernelChoice
from engine.demo_model import resolve_model
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, RequestAbortedError
from engine.kv_cache import KVCachePool, KVLayout
from engine.kv_sizing import KVSizing, size_kv_pool
from engine.logprobs import PromptLogprobs, TokenLogprobs
from engine.memory_profile import DeviceSnapshot, profile_memory
from engine.model import LlamaForward
from engine.model_runner import ModelRunner
from engine.model_spec import load_model_spec
from engine.parallel.capacity import check_weights_fit
from engine.parallel.group import TPGroup
from engine.parallel.shard import ModelShard
from engine.parallel.step_channel import StepChannel
from engine.penalties import RowHistory
from engine.prefix_cache import (
    CacheReport,
    PrefixCache,
    extend_hashes,
    hash_seed,
    salted_root,
)
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceOutput, SequenceStatus
from engine.shaping_state import TokenCounts
from engine.sliding_window import free_out_of_window
from engine.structured import GrammarCompiler
from engine.threads import single_threaded
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STEPS_KEPT = 4096
_ABORTED_IDS_KEPT = 4096
"""Aborts of requests not (yet) seen here, remembered so a late arrival is refused."""


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


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for the step trace (`/admin/steps`): when it started on this
    worker's clock, how long it took, and what it computed."""

    started: float
    seconds: float
    decode_seqs: int
    prefill_seqs: int
    prefill_tokens: int
    threads: int = 0
    """CPU threads the forward ran on (`engine.threads`); 0 where it did not choose."""

    @classmethod
    def of(cls, started: float, seconds: float, chunks: list, threads: int = 0) -> StepRecord:
        prefill = [c for c in chunks if c.num_new_tokens > 1 or not c.seq.output_token_ids]
        return cls(
            started,
            seconds,
            decode_seqs=len(chunks) - len(prefill),
            prefill_seqs=len(prefill),
            prefill_tokens=sum(c.num_new_tokens for c in prefill),
            threads=threads,
        )


class LLMEngine:
    """Synchronous engine; not thread-safe: one owner calls add/abort/step."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        """`tp`: the tensor-parallel group when this engine is rank 0 of a worker of
        several ranks (its followers, `engine.parallel.follower`, run every step it
        runs); None: the whole model here."""
        self.tp = tp or TPGroup.single(config.device)
        config = tp_config(config, self.tp)
        self.num_threads = config.num_threads or torch.get_num_threads()
        """torch threads of every step, set on the thread that steps (`step`)."""
        self.config = config
        self.model_dir, self.model_id = resolve_model(config.model)
        self.spec = load_model_spec(self.model_dir, self.model_id)
        self.max_model_len = min(
            config.max_model_len or self.spec.context_window, self.spec.context_window
        )
        check_weights_fit(
            self.spec,
            ModelShard.of(self.spec, self.tp.size, self.tp.rank),
            config.torch_dtype.itemsize,
            config.device,
            config.gpu_memory_utilization,
        )
        baseline = DeviceSnapshot.take(config.device) if config.sizes_kv_from_device else None
        self.model = self._load_model(config.kernels, config.attention_backend)
        self.kv_window = self.spec.kv_window(self.max_model_len)
        """Every layer's sliding window when all of them slide: KV blocks behind it are
        freed as sequences advance (engine/sliding_window.py); None otherwise."""
        self.layout = KVLayout.for_model(
            self.spec, self.model.kv_dtype, config.block_size, self.model.shard
        )
        self.kv_sizing: KVSizing | None = (
            size_pool(self.model, self.layout, config, self.max_model_len, baseline)
            if baseline
            else None
        )
        """How the pool was sized from the device (None: the config fixed its blocks)."""
        num_blocks = self.kv_sizing.num_blocks if self.kv_sizing else config.fixed_kv_blocks
        num_blocks = self.tp.all_min(num_blocks)  # block ids mean the same on every rank
        with single_threaded():
            self.kv_pool = KVCachePool(self.layout, num_blocks, config.device)
        self.channel = StepChannel(self.tp) if self.tp.parallel else None
        """Where rank 0 of a TP worker sends each step for its followers (None: one rank)."""
        self.allocator = BlockAllocator(
            num_blocks, self._prefix_cache(config), keep_scratch=config.scratch_blocks > 0
        )
        self.scheduler = Scheduler(config, self.allocator)
        self.runner = self._runner()
        if self.kv_sizing is not None:
            logger.info("%s", self.kv_sizing.describe())
        self.sampler = Sampler()
        self.tokenizer = Tokenizer(self.model_dir)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size)
        """Structured output: compiles each constrained request's grammar (lazily)."""
        self.sequences: dict[str, Sequence] = {}
        """Every request this engine owns, whatever its status, until it finishes."""
        self._aborted_ids: OrderedDict[str, None] = OrderedDict()
        self.step_delay_s = envs.step_delay_s()
        self.step_trace: deque[StepRecord] = deque(maxlen=_STEPS_KEPT)
        """The last steps this engine ran (who computed what, when, for how long)."""
        self.prefill_batch_sizes: dict[int, int] = {}
        self.decode_batch_sizes: dict[int, int] = {}

    def _load_model(
        self, kernels: KernelChoice = "auto", attention: AttentionChoice | None = None
    ) -> LlamaForward:
        return load_forward(
            self.config, self.model_dir, self.spec, self.max_model_len, self.tp, kernels, attention
        )

    def rebuild_model(
        self, kernels: KernelChoice = "auto", attention: AttentionChoice | None = None
    ) -> None:
        """The forward rebuilt on another kernel set / attention backend, over the same
        pool; called by `pdserve bench engine --kernels` and the tests of each path."""
        if self.tp.parallel:
            raise ValueError("a tensor-parallel engine's followers cannot rebuild their model")
        self.model = self._load_model(kernels, attention)
        self.runner = self._runner()

    def _runner(self) -> ModelRunner:
        """The step runner over the current model; with CUDA graphs on, they are captured
        here, at start-up (the worker reports healthy only after the engine is built)."""
        runner = ModelRunner(
            self.model,
            self.kv_pool,
            cuda_graphs=self.config.cuda_graphs,
            scratch_block=self.allocator.scratch_block,
            max_model_len=self.max_model_len,
            channel=self.channel,
        )
        runner.capture_graphs(self.config.max_num_seqs)
        return runner

    def stop_followers(self) -> None:
        """Called once by a TP worker's rank 0 at shutdown, after its engine thread
        stopped (the channel is that thread's while it runs): every follower's loop
        ends. A no-op on one rank."""
        if self.channel is not None:
            self.channel.stop()

    # --- requests -----------------------------------------------------------------

    def validate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_after_prefill: bool = False,
    ) -> None:
        """Raise InvalidRequestError for what this engine can never serve, and
        RequestAbortedError for a request whose abort arrived before it did."""
        if request_id in self._aborted_ids:
            raise RequestAbortedError("aborted before it reached this worker", request_id)
        if request_id in self.sequences:
            raise InvalidRequestError("duplicate request id", request_id)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", request_id)
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens including at least one output token",
                request_id,
            )
        tokens = len(prompt_token_ids) + (1 if stop_after_prefill else params.max_tokens)
        tokens = min(tokens, self.max_model_len)
        if blocks_needed(tokens, self.config.block_size) > self.allocator.num_blocks:
            raise InvalidRequestError(
                f"{len(prompt_token_ids)} prompt tokens plus up to "
                f"{tokens - len(prompt_token_ids)} output tokens do not fit this worker's KV "
                f"pool ({self.allocator.num_blocks} blocks of {self.config.block_size})",
                request_id,
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop_after_prefill: bool = False,
        output_token_ids: list[int] | None = None,
        emitted_text_len: int | None = None,
        priority: float | None = None,
    ) -> Sequence:
        """Queue a request. `output_token_ids` resumes one whose tokens were already decided
        elsewhere; `emitted_text_len` says how much of their text the client already has;
        `priority` is its place in line (`Sequence.priority`)."""
        self.validate(request_id, prompt_token_ids, params, stop_after_prefill)
        seq = self._new_sequence(
            request_id, prompt_token_ids, params, output_token_ids, emitted_text_len
        )
        seq.stop_after_prefill = stop_after_prefill
        seq.priority = priority
        if params.prompt_logprobs is not None and not seq.output_token_ids:
            seq.prompt_logprobs = PromptLogprobs(params.prompt_logprobs)
        self.scheduler.add(seq)
        return seq

    def begin_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        num_tokens: int,
        emitted_text_len: int | None = None,
        priority: float | None = None,
    ) -> Sequence:
        """A decode worker announces KV of `num_tokens` coming from a peer: the prompt's,
        or after a migration also that of every output token but the last (which the
        next step feeds). The sequence is IMPORTING: it waits for blocks, which
        `reserve_imports` hands out, then its owner moves the bytes and calls
        `finish_import`; output tokens the import does not cover are computed here."""
        self.validate(request_id, prompt_token_ids, params)
        most = len(prompt_token_ids) + max(len(output_token_ids) - 1, 0)
        if not len(prompt_token_ids) <= num_tokens <= most:
            raise InvalidRequestError(
                f"import of {num_tokens} tokens for a {len(prompt_token_ids)}-token prompt "
                f"with {len(output_token_ids)} output tokens",
                request_id,
            )
        seq = self._new_sequence(
            request_id, prompt_token_ids, params, output_token_ids, emitted_text_len
        )
        seq.import_tokens = num_tokens
        seq.priority = priority
        self.scheduler.add_import(seq)
        return seq

    def reserve_imports(self) -> list[Sequence]:
        """Called by the decode worker's engine loop every iteration: IMPORTING sequences
        that just got their blocks; their transfers may start writing into them."""
        return self.scheduler.reserve_imports()

    def finish_import(
        self, request_id: str, ok: bool, recompute: bool, kept_tokens: int = 0
    ) -> bool:
        """The transfer into an IMPORTING sequence's blocks has stopped writing. On success
        the sequence waits for a batch seat (READY); on failure it recomputes its prompt
        here into the same blocks (`recompute`) or is dropped. An abort that arrived while
        the bytes landed frees the blocks now. Returns whether the sequence lives on.

        `kept_tokens`: on failure, the leading tokens whose KV did land and was verified
        (a streamed import cut mid-stream keeps its segments): only the rest is computed.
        Whole blocks only, and never the last prompt token (it must be sampled from)."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.status != SequenceStatus.IMPORTING:
            raise AssertionError(f"[request {request_id}] finish_import without an import")
        if seq.abort_requested or not (ok or recompute):
            self._drop(seq, "abort" if seq.abort_requested else "error")
            return False
        if ok:
            seq.num_computed_tokens = seq.import_tokens
            self._publish(seq)
            self.scheduler.add_ready(seq)
        else:
            # Blocks that were prefix-cache hits hold their KV; only the rest is computed.
            size = self.config.block_size
            kept = min(kept_tokens, seq.num_prompt_tokens - 1) // size * size
            seq.num_computed_tokens = max(seq.num_published * size, kept)
            self._publish(seq)
            self.scheduler.add(seq)
        return True

    def resume_with(
        self, request_id: str, output_token_ids: list[int], emitted_text_len: int | None
    ) -> None:
        """A streamed import's sequence learns the tokens decided while its KV streamed in
        (the prefill worker's first token): they follow its prompt, as if given to
        `begin_import`. Called by the decode worker before the import settles."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.status != SequenceStatus.IMPORTING or seq.output_token_ids:
            return
        if output_token_ids and len(output_token_ids) >= seq.params.max_tokens:
            raise InvalidRequestError(
                f"resumed with {len(output_token_ids)} decided tokens, at max_tokens "
                f"{seq.params.max_tokens} already",
                request_id,
            )
        seq.output_token_ids = list(output_token_ids)
        if seq.params.structured is not None:
            seq.guide = self.grammars.guide(request_id, seq.params.structured, seq.output_token_ids)
        self._replay_text(seq, emitted_text_len)

    def cancel_import(self, request_id: str, recompute: bool) -> bool:
        """The export went away while the sequence still waited for blocks: recompute the
        prompt here instead, or drop it. False (and nothing done) once its blocks are
        reserved: that transfer fails on its own and `finish_import` decides."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.status != SequenceStatus.IMPORTING or seq.block_ids:
            return False
        self.scheduler.importing.remove(seq)
        if recompute:
            self.scheduler.add(seq)
        else:
            self._drop(seq, "error")
        return True

    def export_prefilled(
        self, request_id: str, export: Callable[[Sequence], T], hand_over: bool = True
    ) -> T:
        """Hand a PREFILLED sequence's blocks to `export` (the KV sender, which pins them
        under a lease and from then on owns them). If `export` raises, the blocks come
        back to the pool here. Raises RequestAbortedError when the request is gone.
        `hand_over` False: `export` took its own references (`pin_blocks`, a streamed
        export), and the sequence's are dropped with it."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.status != SequenceStatus.PREFILLED:
            raise RequestAbortedError("aborted before its KV was exported", request_id)
        try:
            result = export(seq)
        except BaseException:
            self._drop(seq, "error")
            raise
        if hand_over:
            seq.block_ids = []  # owned by the export's lease now
        self._drop(seq, "exported")
        return result

    def pin_blocks(self, block_ids: list[int]) -> None:
        """One more reference on blocks a sequence holds, for an export of them that
        outlives the sequence's own hold (a streamed export's segments); the export's
        end gives it back through `release_blocks`."""
        self.allocator.share(held_blocks(block_ids))

    def _prefix_cache(self, config: EngineConfig) -> PrefixCache | None:
        if not config.prefix_caching:
            return None
        # A block's KV depends on the weights' dtype and on the pool's.
        dtypes = f"{config.resolved_dtype}/kv-{self.layout.dtype}"
        seed = hash_seed(self.model_id, dtypes, config.block_size)
        return PrefixCache(seed, config.block_size)

    def _publish(self, seq: Sequence) -> None:
        """Offer the prefix cache every block of `seq` whose KV just became complete (a
        step filled it or an import landed it); a partly written block never is."""
        cache = self.allocator.cache
        size = self.config.block_size
        full = min(seq.num_computed_tokens // size, len(seq.block_ids))
        if cache is None or full <= seq.num_published:
            return
        root = salted_root(cache.seed, seq.params.cache_salt)
        hashes = extend_hashes(seq.block_hashes, seq.token_slice, root, size, full)
        for index in range(max(seq.num_published, seq.num_freed_blocks), full):
            parent = hashes[index - 1] if index else root
            tokens = tuple(seq.token_slice(index * size, (index + 1) * size))
            cache.publish(seq.block_ids[index], hashes[index], parent, tokens)
        seq.num_published = full

    def cache_report(self) -> CacheReport | None:
        """The prefix cache's state for a health report (safe from any thread)."""
        cache = self.allocator.cache
        return cache.report() if cache is not None else None

    def release_blocks(self, block_ids: list[int]) -> None:
        """Blocks whose export lease ended (ack, abort, expiry) come back to the pool."""
        self.allocator.free(block_ids)

    def _new_sequence(
        self, request_id, prompt_token_ids, params, output_token_ids, emitted_text_len
    ) -> Sequence:
        if output_token_ids and len(output_token_ids) >= params.max_tokens:
            # Its owner missed that it finished; decoding on would add a token too many.
            raise InvalidRequestError(
                f"resumed with {len(output_token_ids)} decided tokens, at max_tokens "
                f"{params.max_tokens} already",
                request_id,
            )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            output_token_ids=list(output_token_ids or []),
        )
        if params.structured is not None:  # grammar state rebuilt from the decided tokens
            seq.guide = self.grammars.guide(request_id, params.structured, seq.output_token_ids)
        self._replay_text(seq, emitted_text_len)
        self.sequences[request_id] = seq
        return seq

    def _replay_text(self, seq: Sequence, emitted_text_len: int | None) -> None:
        """Rebuild the text of tokens decided elsewhere, so that text held back there (a
        partial UTF-8 character, a possible stop string) is still streamed from here."""
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
        )
        for token_id in seq.output_token_ids:
            seq.output_text += seq.detokenizer.push(token_id)
        known = len(seq.output_text) if emitted_text_len is None else emitted_text_len
        seq.emitted_text_len = min(known, len(seq.output_text))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks return to the pool. Idempotent. An
        abort for a request this engine has not seen yet is remembered, so the request is
        refused if it arrives later (the abort overtook it). Blocks that a transfer is
        writing are freed when it stops (`finish_import`)."""
        seq = self.sequences.get(request_id)
        if seq is None:
            self._remember_abort(request_id)
            return False
        if seq.status == SequenceStatus.IMPORTING and seq.block_ids:
            seq.abort_requested = True
            return True
        self._drop(seq, "abort")
        return True

    def hold(self, request_id: str, reader_behind: bool) -> None:
        """Called by a decode worker (on the engine thread) when the driver's queue of a
        request's events filled up (True) or drained (False): backpressure from a slow
        reader, applied at the next step. Unknown requests are ignored."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return
        seq.reader_behind = reader_behind
        if not reader_behind:
            self.scheduler.resume(seq)

    def _remember_abort(self, request_id: str) -> None:
        self._aborted_ids[request_id] = None
        while len(self._aborted_ids) > _ABORTED_IDS_KEPT:
            self._aborted_ids.popitem(last=False)

    def _drop(self, seq: Sequence, reason: str) -> None:
        """Every way out of the engine ends here: blocks freed, sequence forgotten."""
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self.sequences.pop(seq.request_id, None)

    def request_states(self) -> dict[str, str]:
        """Request id -> status name (and `+blocks` when it holds any), for leak checks
        and operators (`/admin/workers`)."""
        return {
            rid: seq.status.name.lower() + ("+blocks" if seq.block_ids else "")
            for rid, seq in self.sequences.items()
        }

    def tokens_left(self) -> dict[str, int]:
        """Request id -> output tokens it may still make (a drill does not count a
        sequence about to finish as something a kill could take)."""
        return {
            rid: seq.params.max_tokens - len(seq.output_token_ids)
            for rid, seq in self.sequences.items()
        }

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting)
            + len(self.scheduler.ready)
            + len(self.scheduler.importing),
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
        torch.set_num_threads(self.num_threads)
        started = clock.now()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._count_batch(chunks)
        result = self.runner.run(chunks)
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
            self._publish(chunk.seq)  # before sampling, which may free the blocks
            if self.kv_window is not None and not chunk.seq.stop_after_prefill:
                free_out_of_window(
                    chunk.seq, self.kv_window, self.config.block_size, self.allocator
                )
        for seq, first_position, logits in result.prompt_logits:
            seq.prompt_logprobs.add(logits, first_position, seq.prompt_token_ids)
        seqs = result.sampling_seqs
        outputs = []
        if seqs:
            sampled = self.sampler.run(
                result.logits,
                [s.params for s in seqs],
                [len(s.output_token_ids) for s in seqs],
                [self._history(s) for s in seqs],
                [s.guide for s in seqs],
                argmax=result.greedy,
            )
            outputs = [
                self._append_token(seq, token, logprobs)
                for seq, token, logprobs in zip(seqs, sampled.tokens, sampled.logprobs, strict=True)
            ]
        self.step_trace.append(
            StepRecord.of(started, clock.now() - started, chunks, self.model.last_threads)
        )
        return outputs

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

    def _history(self, seq: Sequence) -> RowHistory:
        if seq.params.penalized and seq.token_counts is None:
            seq.token_counts = TokenCounts()
        return RowHistory(
            seq.prompt_token_ids,
            seq.output_token_ids,
            self.tokenizer.eos_token_ids,
            seq.token_counts,
        )

    def _append_token(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None = None
    ) -> SequenceOutput:
        if seq.guide is not None:
            seq.guide.accept(token_id)
        prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        seq.output_token_ids.append(token_id)
        seq.output_text += seq.detokenizer.push(token_id)
        reason = self._finish_reason(seq, token_id)
        prefilled = False
        if reason is not None and not seq.params.stop:
            seq.output_text += seq.detokenizer.flush()
        if seq.first_token_at is None:
            seq.first_token_at = clock.now()
        if reason is not None:
            seq.finish_reason = reason
            self._drop(seq, reason)
        elif seq.stop_after_prefill:
            prefilled = True
            self.scheduler.leave_batch(seq)
        return SequenceOutput(
            request_id=seq.request_id,
            token_ids=[token_id],
            text=self._emit_text(seq),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            prefilled=prefilled,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=[logprobs] if logprobs is not None else None,
            prompt_logprobs=prompt_logprobs.result() if prompt_logprobs is not None else None,
        )

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return "stop"
        if seq.guide is not None and seq.guide.done:
            return "stop"
        before_min = len(seq.output_token_ids) < params.min_tokens
        if params.stop and not before_min and _truncate_at_stop(seq):
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


def load_forward(
    config: EngineConfig,
    model_dir,
    spec,
    max_model_len: int,
    tp: TPGroup,
    kernels: KernelChoice = "auto",
    attention: AttentionChoice | None = None,
) -> LlamaForward:
    """This rank's forward of `config`'s model: called by `LLMEngine` (rank 0, or the
    whole model) and by `FollowerEngine` (ranks 1..N-1), so that every rank of a worker
    builds it with the same settings."""
    # One thread: the stepping thread may be another one (engine.threads.single_threaded).
    with single_threaded():
        return LlamaForward(
            model_dir,
            spec,
            config.torch_dtype,
            config.device,
            max_positions=max_model_len,
            attention=attention,
            kernels=kernels,
            kv_dtype=config.kv_torch_dtype,
            block_size=config.block_size,
            deterministic=config.deterministic,
            tp=tp,
        )


def tp_config(config: EngineConfig, tp: TPGroup) -> EngineConfig:
    """The config a rank of `tp` runs: without CUDA graphs on several ranks (their
    all-reduces are not captured), which also keeps every rank's pool the same size."""
    if tp.parallel and config.cuda_graphs:
        return dataclasses.replace(config, cuda_graphs=False)
    return config


def size_pool(
    model: LlamaForward,
    layout: KVLayout,
    config: EngineConfig,
    max_model_len: int,
    baseline: DeviceSnapshot,
) -> KVSizing:
    """The pool's blocks from `gpu_memory_utilization`, after profiling what the
    weights, the largest step and the CUDA graphs take (engine/memory_profile.py);
    raises KVMemoryError (a ValueError) when not one max_model_len sequence fits. Every
    rank of a TP worker calls it at the same point of its start (the profiling step's
    all-reduces meet), then they agree on the smallest count."""
    profile = profile_memory(model, layout, config, max_model_len, baseline)
    return size_kv_pool(
        baseline.total_bytes,
        profile.used_bytes,
        config.gpu_memory_utilization,
        layout.block_nbytes,
        block_size=config.block_size,
        max_model_len=max_model_len,
        scratch_blocks=config.scratch_blocks,
        # What is free now must also hold the graphs and a step's activations.
        free_bytes=max(0, profile.free_bytes - profile.graph_bytes - profile.activation_bytes),
    )


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
