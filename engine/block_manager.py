"""Allocation of KV blocks: a free list, reference counts and per-sequence tables.

Callers check before they mutate (`can_allocate` then `allocate`), so running out
of blocks is a scheduling decision, never an exception in the middle of a step.

With a prefix cache (engine/prefix_cache.py) a block is in one of three states:
referenced (by sequences and export leases: its ref count says how many), free and
never cached (`free_ids`), or free but cached (ref count 0, still named in the cache,
`cache.evictable`). Both free kinds count as free; a fresh block comes from `free_ids`
first and only then by evicting the least recently used cached one, so a block still
referenced is never handed out.
"""

from __future__ import annotations

from collections import deque

from engine.errors import OutOfBlocksError
from engine.prefix_cache import PrefixCache

FREED_BLOCK = -1
"""Placeholder for a leading block a sequence gave back because no layer's sliding
window reaches it any more (`engine.sliding_window`): it keeps its place in the block
table, so that position p still lives in `block_ids[p // block_size]`."""


def held_blocks(block_ids: list[int]) -> list[int]:
    """The blocks of a table the sequence still holds (placeholders left out)."""
    return [b for b in block_ids if b != FREED_BLOCK]


class BlockAllocator:
    """Hands out block ids of one `KVCachePool`; every id is either free or referenced.

    With `keep_scratch` the pool's last block is the scratch block: never handed out,
    never counted (`num_blocks` is what can be handed out), written only by what the
    engine runs for itself (the CUDA graphs' warm-up and padding rows)."""

    def __init__(
        self, num_blocks: int, cache: PrefixCache | None = None, keep_scratch: bool = False
    ):
        """`num_blocks`: blocks in the pool, the scratch block included."""
        self.num_blocks = num_blocks - int(keep_scratch)
        """Blocks this allocator hands out: ids 0 .. num_blocks - 1."""
        self.scratch_block: int | None = self.num_blocks if keep_scratch else None
        self.ref_counts = [0] * self.num_blocks
        self.free_ids: deque[int] = deque(range(self.num_blocks))
        """Free blocks the prefix cache does not hold (handed out first)."""
        self.cache = cache

    @property
    def num_free(self) -> int:
        parked = len(self.cache.evictable) if self.cache is not None else 0
        return len(self.free_ids) + parked

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, request_id: str | None = None) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} KV blocks, {self.num_free} free", request_id)
        ids = [self.free_ids.popleft() if self.free_ids else self.cache.evict() for _ in range(n)]
        for block_id in ids:
            assert self.ref_counts[block_id] == 0, f"block {block_id} handed out twice"
            self.ref_counts[block_id] = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks someone else also holds."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"sharing free block {block_id}"
            self.ref_counts[block_id] += 1

    def num_parked(self, block_ids: list[int]) -> int:
        """How many of these cached blocks are free now (taking them uses free room)."""
        return sum(1 for block_id in block_ids if self.ref_counts[block_id] == 0)

    def take_cached(self, block_ids: list[int]) -> None:
        """Take a reference on prefix-cache hits, in use elsewhere or parked."""
        for block_id in block_ids:
            assert self.cache is not None and self.cache.is_cached(block_id), block_id
            if self.ref_counts[block_id] == 0:
                self.cache.unpark(block_id)
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per id; a block returns to the pool at zero (a cached one
        stays cached, evictable).

        Freed in reverse so a sequence's tail blocks are reused first and its head
        blocks stay warm the longest.
        """
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise AssertionError(f"double free of KV block {block_id}")
            self.ref_counts[block_id] = count - 1
            if count == 1 and (self.cache is None or not self.cache.park(block_id)):
                self.free_ids.append(block_id)

    def assert_all_free(self) -> None:
        """Leak check used by tests and drills: no block may still be referenced (cached
        blocks nobody references are free)."""
        leaked = [i for i, count in enumerate(self.ref_counts) if count]
        if leaked or self.num_free != self.num_blocks:
            raise AssertionError(f"{len(leaked)} KV blocks leaked: {leaked[:16]}")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size
