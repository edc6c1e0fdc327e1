"""Giving back KV blocks that no layer's sliding window reaches any more.

When every layer of a model slides (Mistral, Mixtral, Phi-3, Qwen with all layers
windowed), the query at position p reads only keys in (p - window, p], and later
queries read later keys still: a leading block whose last position is at or before
p - window is dead for good. The engine frees such blocks after each step
(`free_out_of_window`), so a long generation holds about window / block_size blocks
rather than its whole length. A model with any global layer (Gemma alternates them)
frees nothing: that layer still reads every key.

A freed block stays in the sequence's table as `FREED_BLOCK`, so block ids keep their
positions: `block_ids[p // block_size]` is still position p's block, the prefix cache
already has every freed block published (publishing runs first in each step, and a
parked cached block is still a hit for a later prompt), and the attention reads
placeholders as block 0, which the window masks out.

Only sequences whose KV stays in this engine free blocks: a prefill worker's sequence
(`stop_after_prefill`) keeps all of its blocks for the export, whose ticket ships
every block of the prompt, so a transfer never meets a placeholder.
"""

from __future__ import annotations

from engine.block_manager import FREED_BLOCK, BlockAllocator
from engine.sequence import Sequence


def dead_blocks(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks that no query at position `num_computed` or later can see."""
    return max(0, num_computed - window + 1) // block_size


def free_out_of_window(
    seq: Sequence, window: int, block_size: int, allocator: BlockAllocator
) -> int:
    """Free `seq`'s newly dead leading blocks, leaving placeholders; returns how many.
    Called by the engine after each step that computed tokens of `seq`."""
    dead = min(dead_blocks(seq.num_computed_tokens, window, block_size), len(seq.block_ids))
    if dead <= seq.num_freed_blocks:
        return 0
    freed = seq.block_ids[seq.num_freed_blocks : dead]
    allocator.free(freed)
    seq.block_ids[seq.num_freed_blocks : dead] = [FREED_BLOCK] * len(freed)
    seq.num_freed_blocks = dead
    return len(freed)
