"""The CUDA graphs' scratch block: kept out of allocation, out of every capacity count.

Where decode graphs are captured (`cuda_graphs` on a CUDA device), the pool's last
block is where their warm-ups and padding rows write (engine/cuda_graphs.py): the
allocator must never hand it out, whatever mix of allocations, frees, prefix-cache
publications, hits and evictions it sees, and every count built on the allocator
(free blocks, the leak check, the cluster's pool check, request admission) must
count only the blocks it can hand out.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.config import ClusterConfig, ConfigError, PoolConfig
from engine.block_manager import BlockAllocator
from engine.config import EngineConfig
from engine.prefix_cache import PrefixCache

POOL_BLOCKS = 12


class ScratchNeverHandedOut(RuleBasedStateMachine):
    """An allocator with a prefix cache and a scratch block, driven by random calls in
    the order the scheduler and engine make them; a model of who holds what beside it."""

    def __init__(self):
        super().__init__()
        self.allocator = BlockAllocator(POOL_BLOCKS, PrefixCache(seed=7, block_size=4), True)
        self.held: list[list[int]] = []
        """Block lists of live owners (sequences), each holding one reference per block."""
        self.published = 0

    @rule(count=st.integers(1, POOL_BLOCKS))
    def allocate(self, count):
        if self.allocator.can_allocate(count):
            self.held.append(self.allocator.allocate(count, "seq"))
        else:
            assert count > self.allocator.num_free

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        owner = data.draw(st.integers(0, len(self.held) - 1))
        self.allocator.free(self.held.pop(owner))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def publish(self, data):
        """The engine names a complete block, so that freeing it parks it in the cache."""
        blocks = data.draw(st.sampled_from(self.held))
        block = data.draw(st.sampled_from(blocks))
        self.published += 1
        self.allocator.cache.publish(block, self.published, 0, (self.published,))

    @precondition(lambda self: self.allocator.cache.entries)
    @rule(data=st.data())
    def hit(self, data):
        """A prefix-cache hit takes a cached block, parked or in use elsewhere."""
        block = data.draw(st.sampled_from(sorted(self.allocator.cache.entries)))
        if self.allocator.num_parked([block]) <= self.allocator.num_free:
            self.allocator.take_cached([block])
            self.held.append([block])

    @invariant()
    def scratch_stays_out_and_counts_add_up(self):
        allocator = self.allocator
        scratch = allocator.scratch_block
        assert scratch == POOL_BLOCKS - 1 and allocator.num_blocks == POOL_BLOCKS - 1
        held = [block for blocks in self.held for block in blocks]
        assert scratch not in held
        assert scratch not in allocator.free_ids and scratch not in allocator.cache.entries
        assert all(0 <= block < allocator.num_blocks for block in held)
        referenced = {block for block in held}
        for block in range(allocator.num_blocks):
            assert allocator.ref_counts[block] == held.count(block)
        assert allocator.num_free == allocator.num_blocks - len(referenced)
        assert allocator.num_used == len(referenced)

    def teardown(self):
        for blocks in self.held:
            self.allocator.free(blocks)
        self.allocator.assert_all_free()
        # everything back, and the whole usable pool can be handed out at once, no more
        assert not self.allocator.can_allocate(POOL_BLOCKS)
        every = self.allocator.allocate(POOL_BLOCKS - 1, "all")
        assert sorted(every) == list(range(POOL_BLOCKS - 1))


ScratchNeverHandedOut.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_the_scratch_block_is_never_handed_out = ScratchNeverHandedOut.TestCase


def test_only_an_engine_that_captures_graphs_keeps_a_scratch_block():
    assert EngineConfig(device="cuda", num_kv_blocks=8).scratch_blocks == 1
    assert EngineConfig(device="cuda:1", num_kv_blocks=8).usable_kv_blocks == 7
    assert EngineConfig(device="cuda", cuda_graphs=False, num_kv_blocks=8).scratch_blocks == 0
    assert EngineConfig(device="cpu", num_kv_blocks=8).usable_kv_blocks == 8
    with pytest.raises(ValueError, match="scratch block"):
        EngineConfig(device="cuda", num_kv_blocks=1)
    plain = BlockAllocator(4)
    assert plain.scratch_block is None and plain.num_blocks == 4


def test_the_cluster_pool_check_counts_the_scratch_block():
    """A GPU pool must hold one longest sequence besides its scratch block."""
    shape = dict(model="demo", block_size=16, mode="colocated")

    def config(kv_blocks: int, **extra) -> ClusterConfig:
        return ClusterConfig(**shape, decode=PoolConfig(workers=1, kv_blocks=kv_blocks), **extra)

    config(32, gpus_per_worker=0).check_pools(512)
    with pytest.raises(ConfigError, match="plus 1 for the CUDA graphs' scratch"):
        config(32, gpus_per_worker=1).check_pools(512)
    config(33, gpus_per_worker=1).check_pools(512)
    config(32, gpus_per_worker=1, cuda_graphs=False).check_pools(512)
