"""Rank 0's steps, sent to its followers: how a tensor-parallel worker keeps lockstep.

Rank 0's engine owns everything that decides a step (scheduler, block manager, prefix
cache, sampler). Every step its `ModelRunner` packs the step (`StepInputs`) and,
before running its own shard of the forward, sends the packed tensors here; each
follower receives them and runs the same forward over its own shard and its own KV
pool. Block ids mean the same blocks on every rank (every pool has the same block
count), so rank 0's slot mapping and block tables are valid everywhere.

On the wire, two broadcasts per step, no pickle: a fixed header of int64 counts, then
one int64 payload with every tensor of the step back to back:

    input_ids, positions, slot_blocks, slot_offsets   [tokens] each
    logits_rows                                       [rows]
    decode_block_tables, decode_context_lens          [decode x width], [decode]
    per prefill chunk: query_start, query_len, context_start, table_len
    the prefill chunks' block tables, back to back

A follower waits for the header as long as the worker is idle (`IDLE_TIMEOUT`); a
header of kind STOP ends its loop (a worker's shutdown). A dead rank fails the
broadcast on every other rank, which is the worker's death (its health check says so).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.parallel.group import IDLE_TIMEOUT, TPGroup

HEADER_LEN = 8


class StepKind(enum.IntEnum):
    STEP = 1
    STOP = 2


@dataclass
class SentStep:
    """What a follower runs: `LlamaForward.forward`'s arguments (less the pool)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor


class StepChannel:
    """One per rank of a TP worker: rank 0 `send`s, followers `receive`."""

    def __init__(self, tp: TPGroup):
        self.tp = tp
        self.device = tp.device

    # --- rank 0 -------------------------------------------------------------------

    def send(self, input_ids, positions, meta: AttentionMetadata, logits_rows) -> None:
        """Called by rank 0's `ModelRunner` before every forward it runs."""
        chunks = meta.prefill_chunks
        parts = [input_ids, positions, meta.slot_blocks, meta.slot_offsets, logits_rows]
        width = 0
        if meta.num_decode_tokens:
            width = meta.decode_block_tables.shape[1]
            parts += [meta.decode_block_tables.flatten(), meta.decode_context_lens]
        if chunks:
            described = [
                (c.query_start, c.query_len, c.context_start, c.block_table.shape[0])
                for c in chunks
            ]
            parts.append(self._ints([value for chunk in described for value in chunk]))
            parts += [c.block_table for c in chunks]
        payload = torch.cat([p.to(torch.long) for p in parts])
        header = [
            StepKind.STEP,
            input_ids.shape[0],
            meta.num_decode_tokens,
            width,
            len(chunks),
            logits_rows.shape[0],
            payload.shape[0],
            0,
        ]
        self.tp.broadcast(self._ints(header))
        self.tp.broadcast(payload)

    def stop(self) -> None:
        """Called by rank 0 at shutdown: every follower's loop ends."""
        self.tp.broadcast(self._ints([StepKind.STOP] + [0] * (HEADER_LEN - 1)))

    # --- followers --------------------------------------------------------------------

    def receive(self) -> SentStep | None:
        """The next step rank 0 sent; None when it sent STOP. Blocks while rank 0 idles."""
        header = self.tp.broadcast(self._ints([0] * HEADER_LEN), timeout=IDLE_TIMEOUT)
        kind, tokens, decode, width, num_chunks, rows, length, _ = header.tolist()
        if kind == StepKind.STOP:
            return None
        payload = self.tp.broadcast(torch.empty(length, dtype=torch.long, device=self.device))
        at = 0

        def take(count: int) -> torch.Tensor:
            nonlocal at
            part = payload[at : at + count]
            at += count
            return part

        input_ids, positions, slot_blocks, slot_offsets = (take(tokens) for _ in range(4))
        logits_rows = take(rows)
        meta = AttentionMetadata(slot_blocks, slot_offsets, num_decode_tokens=decode)
        if decode:
            meta.decode_block_tables = take(decode * width).view(decode, width)
            meta.decode_context_lens = take(decode)
        described = take(4 * num_chunks).view(num_chunks, 4).tolist()
        meta.prefill_chunks = [
            PrefillChunk(start, length, context, take(table))
            for start, length, context, table in described
        ]
        return SentStep(input_ids, positions, meta, logits_rows)

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
