"""Chooses, each step, how many new tokens of which sequences go into the forward pass.

Every sequence is scheduled the same way: its next `num_tokens - num_computed_tokens`
tokens, capped by the prefill chunk size and the step's token budget. A fresh prompt
is a long piece, a decode step is one token, a preempted sequence recomputes prompt
plus outputs. Running sequences go first (oldest first) so decode never starves;
waiting ones are admitted while blocks and seats last. When a running sequence needs
a block and none is free, the youngest running sequence is preempted: its blocks are
freed and it waits to be recomputed, rather than failing.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockAllocator, blocks_needed
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    """Owned by one engine; `schedule` is called once per step."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in the pool (imported) joins the decode batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        for seq in sorted(self.running, key=lambda s: s.arrival_time):
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue
            num_new = self._piece(seq, budget)
            if not self._grow(seq, num_new):
                continue
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._piece(seq, budget)
            extra = self._missing_blocks(seq, num_new)
            if not self.allocator.can_allocate(extra):
                break
            self.waiting.popleft()
            seq.block_ids += self.allocator.allocate(extra, seq.request_id)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = time.time()
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return chunks

    def _piece(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        return min(remaining, self.config.prefill_chunk_size, budget)

    def _missing_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` lacks to hold its computed tokens plus `num_new` more."""
        total = seq.num_computed_tokens + num_new
        return blocks_needed(total, self.config.block_size) - len(seq.block_ids)

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Make room for `num_new` more tokens of a running sequence, preempting if needed."""
        needed = self._missing_blocks(seq, num_new)
        while not self.allocator.can_allocate(needed):
            victim = self._youngest_running()
            self.preempt(victim)
            if victim is seq:
                return False
        if needed > 0:
            seq.block_ids += self.allocator.allocate(needed, seq.request_id)
        return True

    def _youngest_running(self) -> Sequence:
        candidates = [s for s in self.running if s.status == SequenceStatus.RUNNING]
        return max(candidates, key=lambda s: s.arrival_time)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it will recompute prompt + outputs later."""
        self.running.remove(seq)
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, release_blocks: bool = True) -> None:
        """Take a sequence out of the schedule; its blocks go back unless exported."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if release_blocks and seq.block_ids:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
