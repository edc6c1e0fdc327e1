"""Turns a list of scheduled chunks into one packed forward step and its logits.

Decode pieces (one token) go first and are attended in one batched call; prefill
pieces follow, each attending to its own cached context. Logits are computed only
for sequences whose piece reaches their last known token, since only they sample.
On CUDA, decode-only steps replay a graph per batch-size bucket, captured at
start-up (`engine.cuda_graphs`) when enabled; everywhere else the step runs eagerly. On the
native CPU kernels a decode-only step skips the tensors: its rows go to the fused
kernel as plain ints (`decode_rows`, `LlamaForward.decode`), which also returns each
row's greedy token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.kv_cache import KVCachePool
from engine.model import LlamaForward
from engine.native.decode_step import DecodeRows
from engine.parallel.step_channel import StepChannel
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence


@dataclass
class StepResult:
    logits: torch.Tensor
    """[len(sampling_seqs), vocab] float32, valid until the next step."""
    sampling_seqs: list[Sequence]
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
    """(sequence, first position, logits [positions, vocab]) for sequences that want
    prompt logprobs (`Sequence.prompt_logprobs`); empty on every other step."""
    greedy: list[int] | None = None
    """Each row's argmax, where the step computed it (the fused decode kernel)."""


@dataclass
class StepInputs:
    """One packed step's tensors, as `LlamaForward.forward` takes them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampling_seqs: list[Sequence]
    prompt_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)
    """(sequence, first position, count): extra logits rows after the sampling ones."""

    @property
    def decode_only(self) -> bool:
        return not self.meta.prefill_chunks


class ModelRunner:
    """Owned by an engine; `run` is called once per step with the scheduler's chunks."""

    def __init__(
        self,
        model: LlamaForward,
        kv_pool: KVCachePool,
        cuda_graphs: bool = False,
        scratch_block: int | None = None,
        max_model_len: int | None = None,
        channel: StepChannel | None = None,
    ):
        """`cuda_graphs`: replay captured graphs for decode-only steps on CUDA (the engine
        passes its config's `cuda_graphs`, and the allocator's `scratch_block`, which the
        graphs write to outside real rows); ignored on other devices. Nothing is captured
        until `capture_graphs`. `channel`: rank 0 of a tensor-parallel worker sends every
        step there before running it, for its followers to run too."""
        self.model = model
        self.kv_pool = kv_pool
        self.device = model.device
        self.channel = channel
        self.graphs = None
        if cuda_graphs and torch.device(self.device).type == "cuda":
            from engine.cuda_graphs import DecodeGraphs

            if scratch_block is None:
                raise ValueError("CUDA graphs need a scratch block to write their padding to")
            self.graphs = DecodeGraphs(model, kv_pool, scratch_block, max_model_len)

    def capture_graphs(self, max_num_seqs: int) -> None:
        """Capture the decode graphs of every batch bucket up to `max_num_seqs`; called by
        the engine at start-up, before its worker reports healthy (no-op without graphs)."""
        if self.graphs is not None:
            self.graphs.capture_all(max_num_seqs)

    def run(self, chunks: list[ScheduledChunk]) -> StepResult:
        rows = self.decode_rows(chunks) if self.model.fused_decode is not None else None
        fused = self.model.decode(rows, self.kv_pool) if rows is not None else None
        if fused is not None:
            return StepResult(fused.logits, [c.seq for c in chunks], greedy=fused.greedy)
        step = self.build_step(chunks)
        graphed = step.decode_only and not step.prompt_rows
        if self.graphs is not None and graphed and self.graphs.covers(step):
            logits = self.graphs.run(step)
        else:
            if self.channel is not None:
                self.channel.send(step.input_ids, step.positions, step.meta, step.logits_rows)
            logits = self.model.forward(
                step.input_ids, step.positions, step.meta, self.kv_pool, step.logits_rows
            )
        if not step.prompt_rows:
            return StepResult(logits=logits, sampling_seqs=step.sampling_seqs)
        return self._split_prompt_rows(logits, step)

    @staticmethod
    def _split_prompt_rows(logits: torch.Tensor, step: StepInputs) -> StepResult:
        row = len(step.sampling_seqs)
        prompt_logits = []
        for seq, first, count in step.prompt_rows:
            prompt_logits.append((seq, first, logits[row : row + count]))
            row += count
        return StepResult(logits[: len(step.sampling_seqs)], step.sampling_seqs, prompt_logits)

    def build_step(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Pack the chunks (decode first) into the step's token, position and slot tensors."""
        decode = [c for c in chunks if c.num_new_tokens == 1]
        prefill = [c for c in chunks if c.num_new_tokens > 1]
        tokens, positions, slot_blocks, slot_offsets = [], [], [], []
        logits_rows, sampling_seqs, prompt_rows = [], [], []
        block_size = self.kv_pool.block_size
        for chunk in decode + prefill:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            tokens += seq.token_slice(start, end)
            span = range(start, end)
            offset = self.model.rope_offset(seq.num_prompt_tokens)
            positions += span if not offset else range(start + offset, end + offset)
            slot_blocks += [seq.block_ids[p // block_size] for p in span]
            slot_offsets += [p % block_size for p in span]
            if end == seq.num_tokens:
                logits_rows.append(len(tokens) - 1)
                sampling_seqs.append(seq)
            if seq.prompt_logprobs is not None:
                wanted = seq.prompt_logprobs.wanted(start, end, seq.num_prompt_tokens)
                if wanted:
                    first_row = len(tokens) - (end - start) + (wanted.start - start)
                    prompt_rows.append((seq, wanted.start, len(wanted), first_row))
        extra_rows = [r for _, _, count, first in prompt_rows for r in range(first, first + count)]
        meta = AttentionMetadata(
            slot_blocks=self._tensor(slot_blocks),
            slot_offsets=self._tensor(slot_offsets),
            num_decode_tokens=len(decode),
        )
        if decode:
            meta.decode_block_tables, meta.decode_context_lens = self._decode_tables(decode)
        meta.prefill_chunks = self._prefill_chunks(prefill, first_row=len(decode))
        return StepInputs(
            self._tensor(tokens),
            self._tensor(positions),
            meta,
            self._tensor(logits_rows + extra_rows),
            sampling_seqs,
            [(seq, first, count) for seq, first, count, _ in prompt_rows],
        )

    def decode_rows(self, chunks: list[ScheduledChunk]) -> DecodeRows | None:
        """The step as plain ints for the fused decode kernel, when every chunk is its
        sequence's next token (each row samples, none wants prompt logprobs); else None."""
        block_size = self.kv_pool.block_size
        tokens, positions, blocks, offsets = [], [], [], []
        for chunk in chunks:
            seq, position = chunk.seq, chunk.seq.num_computed_tokens
            if chunk.num_new_tokens != 1 or position + 1 != seq.num_tokens:
                return None
            if seq.prompt_logprobs is not None:
                return None
            tokens += seq.token_slice(position, position + 1)
            positions.append(position + self.model.rope_offset(seq.num_prompt_tokens))
            blocks.append(seq.block_ids[position // block_size])
            offsets.append(position % block_size)
        tables, lens = self._padded_tables(chunks)
        return DecodeRows(tokens, positions, blocks, offsets, lens, tables)

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _decode_tables(self, decode: list[ScheduledChunk]):
        tables, context_lens = self._padded_tables(decode)
        return self._tensor(tables), self._tensor(context_lens)

    def _padded_tables(self, decode: list[ScheduledChunk]) -> tuple[list[list[int]], list[int]]:
        """Decode rows' block tables, padded to the widest, and their context lengths."""
        block_size = self.kv_pool.block_size
        context_lens = [c.seq.num_computed_tokens + 1 for c in decode]
        width = max((n + block_size - 1) // block_size for n in context_lens)
        return [_padded(c.seq.block_ids, width) for c in decode], context_lens

    def _prefill_chunks(self, prefill: list[ScheduledChunk], first_row: int) -> list[PrefillChunk]:
        block_size = self.kv_pool.block_size
        pieces, row = [], first_row
        for chunk in prefill:
            seq = chunk.seq
            context_len = seq.num_computed_tokens + chunk.num_new_tokens
            num_blocks = (context_len + block_size - 1) // block_size
            pieces.append(
                PrefillChunk(
                    query_start=row,
                    query_len=chunk.num_new_tokens,
                    context_start=seq.num_computed_tokens,
                    block_table=self._tensor(_padded(seq.block_ids, num_blocks)),
                )
            )
            row += chunk.num_new_tokens
        return pieces


def _padded(block_ids: list[int], width: int) -> list[int]:
    """The first `width` block ids, padded with block 0 (masked out by context length);
    freed leading blocks (`FREED_BLOCK`) read as block 0 too: they lie outside every
    layer's window, which masks them out."""
    head = block_ids[:width]
    if head and head[0] < 0:
        head = [max(b, 0) for b in head]
    return head + [0] * (width - len(head))
