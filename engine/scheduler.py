"""Chooses, each step, how many new tokens of which sequences go into the forward pass.

Every sequence is scheduled the same way: its next `num_tokens - num_computed_tokens`
tokens, capped by the prefill chunk size and the step's token budget. A fresh prompt
is a long piece, a decode step is one token, a preempted sequence recomputes prompt
plus outputs. Running sequences go first (oldest first) so decode never starves.
Then seats in the batch (`max_num_seqs`) go to READY sequences, whose KV was imported
and already sits in the pool, and then to WAITING ones, while blocks last. When a
running sequence needs a block and none is free, the youngest running sequence is
preempted: its blocks are freed and it waits to be recomputed, rather than failing.

Imports wait in their own queue for blocks (`reserve_imports`), FIFO, leaving one
block of headroom per running sequence so that admitting an import does not at once
force a preemption of a stream that is decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine import clock
from engine.block_manager import BlockAllocator, blocks_needed
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    """Owned by one engine; `schedule` is called once per step, the rest by the engine."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.importing: deque[Sequence] = deque()
        """IMPORTING sequences still waiting for blocks."""
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queues -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_import(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.IMPORTING
        self.importing.append(seq)

    def add_ready(self, seq: Sequence) -> None:
        """An imported sequence, KV in the pool, waits for a seat in the batch."""
        seq.status = SequenceStatus.READY
        self.ready.append(seq)

    def has_work(self) -> bool:
        """Anything a step could compute (imports waiting for blocks are not)."""
        return bool(self.waiting or self.ready or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of every queue and free its blocks: finish, abort, hand-off."""
        for queue in (self.waiting, self.ready, self.importing):
            if seq in queue:
                queue.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []

    def reserve_imports(self) -> list[Sequence]:
        """Give blocks to queued imports, oldest first, while the pool has them to spare.
        Returns the sequences that got theirs: their transfers can start now."""
        reserved = []
        headroom = len(self.running)
        while self.importing:
            seq = self.importing[0]
            needed = blocks_needed(seq.import_tokens, self.config.block_size)
            if not self.allocator.can_allocate(needed + headroom):
                break
            self.importing.popleft()
            seq.block_ids = self.allocator.allocate(needed, seq.request_id)
            reserved.append(seq)
        return reserved

    # --- one step ---------------------------------------------------------------------

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        for seq in sorted(self.running, key=lambda s: s.arrival_time):
            if budget <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._piece(seq, budget)
            if not self._grow(seq, num_new):
                continue
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        for queue in (self.ready, self.waiting):
            budget = self._seat(queue, budget, chunks)
        return chunks

    def _seat(self, queue: deque[Sequence], budget: int, chunks: list[ScheduledChunk]) -> int:
        """Move sequences from the head of `queue` into the batch while seats, budget and
        blocks last; returns the budget left."""
        while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = queue[0]
            num_new = self._piece(seq, budget)
            extra = self._missing_blocks(seq, num_new)
            if not self.allocator.can_allocate(extra):
                break
            queue.popleft()
            if extra > 0:
                seq.block_ids += self.allocator.allocate(extra, seq.request_id)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_at is None:
                seq.first_scheduled_at = clock.now()
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return budget

    def _piece(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        return min(remaining, self.config.prefill_chunk_size, budget)

    def _missing_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` lacks to hold its computed tokens plus `num_new` more."""
        total = seq.num_computed_tokens + num_new
        return max(0, blocks_needed(total, self.config.block_size) - len(seq.block_ids))

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
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def leave_batch(self, seq: Sequence) -> None:
        """A prefill worker's sequence stops computing but keeps its blocks (PREFILLED)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PREFILLED
