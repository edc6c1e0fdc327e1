"""Chooses, each step, how many new tokens of which sequences go into the forward pass.

Every sequence is scheduled the same way: its next `num_tokens - num_computed_tokens`
tokens, capped by the prefill chunk size and the step's token budget. A fresh prompt
is a long piece, a decode step is one token, a preempted sequence recomputes prompt
plus outputs. Running sequences go first (oldest first) so decode never starves.
Then seats in the batch (`max_num_seqs`) go to READY sequences, whose KV was imported
and already sits in the pool, and then to WAITING ones, while blocks last. When a
running sequence needs a block and none is free, the youngest running sequence is
preempted: its blocks are freed and it waits to be recomputed, rather than failing.
A sequence whose reader fell behind (`Sequence.reader_behind`) is held out of line,
keeping its blocks until the reader catches up; should another sequence need blocks
meanwhile, held sequences give theirs up first and are recomputed when they resume.

Imports wait in their own queue for blocks (`reserve_imports`), FIFO, leaving one
block of headroom per sequence that holds KV and will grow (running, READY, landing,
and the import itself) so that admitting an import does not at once force a
preemption of a stream that is decoding, nor take the block a READY sequence needs
for its next token. Should nothing be able to run anyway (every block held by READY
sequences waiting for a block to grow into), the youngest READY sequence gives its
blocks back and is recomputed later: the batch never stalls with work queued.

With a prefix cache, a sequence taking its seat with no KV yet (fresh, preempted)
first takes the longest cached chain of its leading full blocks and computes only the
rest; at least its last token is always computed, since it must be sampled from. An
import takes its cached blocks the same way and has only the others written by the
transfer. Either way nothing is taken before the room for the rest is checked.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine import clock
from engine.block_manager import BlockAllocator, blocks_needed, held_blocks
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
        self.landing: list[Sequence] = []
        """IMPORTING sequences whose blocks are reserved: their bytes are moving."""
        self.held: list[Sequence] = []
        """HELD sequences: their readers are behind (`hold_behind`, `resume`)."""
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queues -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence to compute, in line order: one that reached the cluster
        earlier (a stream rebuilt after its decode worker died) waits ahead of those
        that came after it; arrivals in order simply append."""
        self._landed(seq)
        seq.status = SequenceStatus.WAITING
        place = len(self.waiting)
        while place > 0 and _line(self.waiting[place - 1]) > _line(seq):
            place -= 1
        self.waiting.insert(place, seq)

    def add_import(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.IMPORTING
        self.importing.append(seq)

    def add_ready(self, seq: Sequence) -> None:
        """An imported sequence, KV in the pool, waits for a seat in the batch."""
        self._landed(seq)
        seq.status = SequenceStatus.READY
        self.ready.append(seq)

    def has_work(self) -> bool:
        """Anything a step could compute (imports waiting for blocks are not)."""
        return bool(self.waiting or self.ready or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of every queue and free its blocks: finish, abort, hand-off."""
        for queue in (self.waiting, self.ready, self.importing, self.held):
            if seq in queue:
                queue.remove(seq)
        self._landed(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)

    def _landed(self, seq: Sequence) -> None:
        if seq in self.landing:
            self.landing.remove(seq)

    def release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.allocator.free(held_blocks(seq.block_ids))
            seq.block_ids = []
        seq.num_freed_blocks = 0

    def reserve_imports(self) -> list[Sequence]:
        """Give blocks to queued imports, oldest first, while the pool has them to spare.
        Returns the sequences that got theirs: their transfers can start now. The first
        `num_cached_tokens // block_size` of them are prefix-cache hits, already holding
        their KV; the transfer writes only the others."""
        reserved = []
        while self.importing:
            seq = self.importing[0]
            headroom = self._import_headroom()
            hits = self._cached_prefix(seq, seq.import_tokens // self.config.block_size)
            needed = blocks_needed(seq.import_tokens, self.config.block_size) - len(hits)
            if not self.allocator.can_allocate(needed + self.allocator.num_parked(hits) + headroom):
                break
            self.importing.popleft()
            self._take_hits(seq, hits, seq.import_tokens)
            seq.block_ids += self.allocator.allocate(needed, seq.request_id)
            self.landing.append(seq)
            reserved.append(seq)
        return reserved

    def _import_headroom(self) -> int:
        """Blocks an import must leave free: one per sequence that holds KV and will grow
        (running, READY, landing), and one for the import's own next token."""
        return len(self.running) + len(self.ready) + len(self.landing) + 1

    def _cached_prefix(self, seq: Sequence, max_blocks: int) -> list[int]:
        """The cached blocks `seq` could start from; none unless it holds no KV yet."""
        cache = self.allocator.cache
        if cache is None or seq.block_ids or seq.num_computed_tokens or max_blocks <= 0:
            return []
        if seq.prompt_logprobs is not None:
            return []  # its prompt logprobs need the logits of every prompt position
        return cache.match(seq.block_hashes, seq.token_slice, max_blocks, seq.params.cache_salt)

    def _take_hits(self, seq: Sequence, hits: list[int], looked_up: int) -> None:
        """`seq` takes its cached blocks (room checked by the caller)."""
        cache = self.allocator.cache
        if cache is None:
            return
        hit_tokens = len(hits) * self.config.block_size
        cache.count_lookup(looked_up, hit_tokens)
        if seq.first_scheduled_at is None:
            seq.num_cached_tokens = hit_tokens
        if hits:
            self.allocator.take_cached(hits)
            seq.block_ids = list(hits)
            seq.num_published = len(hits)

    # --- one step ---------------------------------------------------------------------

    def hold_behind(self) -> None:
        """Take every sequence whose reader is behind out of line (the engine calls this
        before each step: the flag is set between steps, and a sequence that lands or
        is seated later is caught at the next one)."""
        for queue in (self.running, self.ready, self.waiting):
            for seq in [s for s in queue if s.reader_behind]:
                queue.remove(seq)
                seq.status = SequenceStatus.HELD
                self.held.append(seq)

    def resume(self, seq: Sequence) -> None:
        """Its reader caught up: back in line, to a seat with the KV it kept, or to be
        recomputed if its blocks went to another sequence meanwhile."""
        if seq not in self.held:
            return
        self.held.remove(seq)
        if seq.num_computed_tokens:
            self.add_ready(seq)
        else:
            self.add(seq)

    def _evict_held(self) -> bool:
        """Free the blocks of the held sequence last in line that has any; False if none
        has. It is recomputed when it resumes."""
        holding = [s for s in self.held if s.block_ids]
        if not holding:
            return False
        seq = max(holding, key=_line)
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.num_published = 0
        self.num_preemptions += 1
        return True

    def schedule(self) -> list[ScheduledChunk]:
        self.hold_behind()
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        for seq in sorted(self.running, key=_line):
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
        while not chunks and not self.running and self.ready:
            # Deadlock breaker: READY sequences hold every block and none can grow.
            self._evict_youngest_ready()
            for queue in (self.ready, self.waiting):
                budget = self._seat(queue, budget, chunks)
        return chunks

    def _evict_youngest_ready(self) -> None:
        """Free the blocks of the READY sequence last in line; it is recomputed (its
        published blocks stay in the prefix cache, where it finds them again)."""
        seq = max(self.ready, key=_line)
        self.ready.remove(seq)
        self._recompute_later(seq)

    def _seat(self, queue: deque[Sequence], budget: int, chunks: list[ScheduledChunk]) -> int:
        """Move sequences from the head of `queue` into the batch while seats, budget and
        blocks last; returns the budget left. READY sequences are seated in line order
        (`Sequence.priority`), whatever order their imports landed in."""
        if queue is self.ready and len(queue) > 1:
            ordered = sorted(queue, key=_line)
            queue.clear()
            queue.extend(ordered)
        while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = queue[0]
            fresh = not seq.block_ids and not seq.num_computed_tokens
            # At least the last token is computed: its logits are sampled.
            hits = self._cached_prefix(seq, (seq.num_tokens - 1) // self.config.block_size)
            start = len(hits) * self.config.block_size if fresh else seq.num_computed_tokens
            num_new = min(seq.num_tokens - start, self.config.prefill_chunk_size, budget)
            held = len(hits) if fresh else len(seq.block_ids)
            extra = max(0, blocks_needed(start + num_new, self.config.block_size) - held)
            if not self.allocator.can_allocate(extra + self.allocator.num_parked(hits)):
                if self._evict_held():
                    continue
                break
            queue.popleft()
            if fresh:
                self._take_hits(seq, hits, seq.num_tokens)
                seq.num_computed_tokens = start
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
            if self._evict_held():
                continue
            victim = self._youngest_running()
            self.preempt(victim)
            if victim is seq:
                return False
        if needed > 0:
            seq.block_ids += self.allocator.allocate(needed, seq.request_id)
        return True

    def _youngest_running(self) -> Sequence:
        candidates = [s for s in self.running if s.status == SequenceStatus.RUNNING]
        return max(candidates, key=_line)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it will recompute prompt + outputs later."""
        self.running.remove(seq)
        self._recompute_later(seq)

    def _recompute_later(self, seq: Sequence) -> None:
        """A sequence just taken out of its queue gives its blocks back and waits, first
        in line, to recompute its prompt and outputs (a preemption)."""
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.num_published = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def leave_batch(self, seq: Sequence) -> None:
        """A prefill worker's sequence stops computing but keeps its blocks (PREFILLED)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PREFILLED


def _line(seq: Sequence) -> tuple[float, str]:
    """Place in line: the cluster arrival (or the local one), the request id breaking ties."""
    return (seq.order, seq.request_id)
