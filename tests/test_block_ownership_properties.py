"""Property: whatever mix of requests, imports, exports, aborts and preemptions an engine
sees, every KV block is either free or owned, and its reference count is exactly the
number of its owners (live sequences and export leases), and everything comes back
when the work is gone.

With the prefix cache on, prompts share prefixes, so blocks are shared: a block with
two or more owners must be a published (cached) one, a cached block nobody references
is "free but cached" (evictable, never owned), and an eviction never hands out a block
that is still referenced (the allocator asserts it).

Runs the real `LLMEngine` (tiny random model, a 24-block pool so that preemption and
eviction happen) under hypothesis' stateful testing.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from engine.errors import InvalidRequestError, RequestAbortedError
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from tests.factories import make_engine

POOL_BLOCKS = 24
ENGINE = {}
IDS = itertools.count()
"""Request ids stay unique across examples: the engine remembers aborted ones."""
PREFIXES = [[(11 * i + 7 * k) % 300 + 3 for i in range(40)] for k in range(3)]
"""Prompts start with one of these (or nothing), so the prefix cache has hits."""


def prompt_for(prefix: int, shared: int, length: int, salt: int) -> list[int]:
    head = PREFIXES[prefix][:shared] if prefix < len(PREFIXES) else []
    return (head + [(5 * i + salt) % 300 + 3 for i in range(length)])[: max(length, 1)]


def engine_for(model_dir):
    if "engine" not in ENGINE:
        ENGINE["engine"] = make_engine(
            model_dir,
            num_kv_blocks=POOL_BLOCKS,
            block_size=8,
            max_model_len=128,
            prefill_chunk_size=16,
            max_batch_tokens=32,
            max_num_seqs=6,
        )
    return ENGINE["engine"]


class BlockOwnership(RuleBasedStateMachine):
    """One engine, driven by random calls in the orders its owners may make them."""

    model_dir = None
    ids = Bundle("ids")
    leases = Bundle("leases")

    @initialize()
    def start(self):
        """Every example starts from the same state, so that hypothesis can replay it: the
        shared engine's prefix cache emptied (cached blocks from earlier examples would
        change what fits), and prompts numbered from 0 (ids stay unique across examples:
        an engine refuses an id it has aborted)."""
        self.engine = engine_for(self.model_dir)
        allocator = self.engine.allocator
        allocator.assert_all_free()
        while allocator.cache.evictable:
            allocator.free_ids.append(allocator.cache.evict())
        self.example = next(IDS)
        self.counter = 0
        self.landing: set[str] = set()
        """Imports whose blocks are reserved: a transfer is writing them."""
        self.lent: list[list[int]] = []

    def _new_id(self) -> str:
        self.counter += 1
        return f"e{self.example}-r{self.counter:03d}"

    @rule(
        target=ids,
        prompt_len=st.integers(1, 60),
        max_tokens=st.integers(1, 40),
        prefill_only=st.booleans(),
        prefix=st.integers(0, 3),
        shared=st.integers(0, 40),
    )
    def add(self, prompt_len, max_tokens, prefill_only, prefix, shared):
        request_id = self._new_id()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = prompt_for(prefix, shared, prompt_len, self.counter)
        with contextlib.suppress(InvalidRequestError):  # too big for the pool: refused up front
            self.engine.add_request(request_id, prompt, params, stop_after_prefill=prefill_only)
        return request_id

    @rule(
        target=ids,
        prompt_len=st.integers(1, 60),
        max_tokens=st.integers(1, 40),
        prefix=st.integers(0, 3),
        shared=st.integers(0, 40),
    )
    def begin_import(self, prompt_len, max_tokens, prefix, shared):
        request_id = self._new_id()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = prompt_for(prefix, shared, prompt_len, 3 * self.counter)
        with contextlib.suppress(InvalidRequestError):
            self.engine.begin_import(request_id, prompt, [7], params, len(prompt))
        return request_id

    @rule()
    def reserve_imports(self):
        self.landing.update(seq.request_id for seq in self.engine.reserve_imports())

    @rule(ok=st.booleans(), recompute=st.booleans(), data=st.data())
    def land(self, ok, recompute, data):
        if not self.landing:
            return
        request_id = data.draw(st.sampled_from(sorted(self.landing)))
        self.landing.discard(request_id)
        self.engine.finish_import(request_id, ok, recompute)

    @rule(request_id=ids)
    def abort(self, request_id):
        self.engine.abort(request_id)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()

    @rule(target=leases, request_id=ids)
    def export(self, request_id):
        try:
            blocks = self.engine.export_prefilled(request_id, lambda seq: list(seq.block_ids))
        except RequestAbortedError:
            return []
        self.lent.append(blocks)
        return blocks

    @rule(blocks=consumes(leases))
    def release_lease(self, blocks):
        if blocks in self.lent:
            self.lent.remove(blocks)
            self.engine.release_blocks(blocks)

    @invariant()
    def every_block_is_free_or_counted_once_per_owner(self):
        if not hasattr(self, "engine"):
            return
        owned = [b for seq in self.engine.sequences.values() for b in seq.block_ids]
        owned += [b for blocks in self.lent for b in blocks]
        owners = Counter(owned)
        allocator, cache = self.engine.allocator, self.engine.allocator.cache
        free = set(allocator.free_ids)
        parked = set(cache.evictable)
        assert len(free) == len(allocator.free_ids), "a block is on the free list twice"
        assert not free & parked, "a block is both plain free and cached free"
        assert not (free | parked) & set(owners), "a free block is owned"
        assert len(free) + len(parked) + len(owners) == POOL_BLOCKS, "a block is lost"
        assert all(allocator.ref_counts[b] == n for b, n in owners.items())
        assert all(allocator.ref_counts[b] == 0 for b in free | parked)
        assert all(cache.is_cached(b) for b in parked), "an evictable block is not cached"
        shared = [b for b, n in owners.items() if n > 1]
        assert all(cache.is_cached(b) for b in shared), "an unpublished block is shared"
        for seq in self.engine.sequences.values():
            assert len(seq.block_ids) == len(set(seq.block_ids)), "a sequence holds a block twice"
        for seq in self.engine.sequences.values():
            if seq.status == SequenceStatus.IMPORTING and not seq.block_ids:
                assert seq in self.engine.scheduler.importing

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for request_id in sorted(self.landing):
            self.engine.finish_import(request_id, ok=False, recompute=False)
        for request_id in list(self.engine.sequences):
            self.engine.abort(request_id)
        for blocks in self.lent:
            self.engine.release_blocks(blocks)
        assert self.engine.sequences == {}
        self.engine.allocator.assert_all_free()


@pytest.fixture
def machine(tiny_llama_dir):
    BlockOwnership.model_dir = tiny_llama_dir
    return BlockOwnership


def test_blocks_are_always_free_or_owned_once(machine):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=100,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
