"""Allocation of KV blocks: a free list, reference counts and per-sequence tables.

Callers check before they mutate (`can_allocate` then `allocate`), so running out
of blocks is a scheduling decision, never an exception in the middle of a step.
"""

from __future__ import annotations

from collections import deque

from engine.errors import OutOfBlocksError


class BlockAllocator:
    """Hands out block ids of one `KVCachePool`; every id is either free or referenced."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def allocate(self, n: int, request_id: str | None = None) -> list[int]:
        if n > len(self.free_ids):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self.free_ids)} free", request_id)
        ids = [self.free_ids.popleft() for _ in range(n)]
        for block_id in ids:
            assert self.ref_counts[block_id] == 0, f"block {block_id} handed out twice"
            self.ref_counts[block_id] = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks someone else also holds."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"sharing free block {block_id}"
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per id; a block returns to the pool at zero.

        Freed in reverse so a sequence's tail blocks are reused first and its head
        blocks stay warm the longest.
        """
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise AssertionError(f"double free of KV block {block_id}")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.free_ids.append(block_id)

    def assert_all_free(self) -> None:
        """Leak check used by tests and drills: no block may still be referenced."""
        leaked = [i for i, count in enumerate(self.ref_counts) if count]
        if leaked or len(self.free_ids) != self.num_blocks:
            raise AssertionError(f"{len(leaked)} KV blocks leaked: {leaked[:16]}")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size
