"""Property: whatever mix of requests, imports, exports, aborts and preemptions an engine
sees, every KV block is either free or owned by exactly one live sequence or one
export lease, and everything comes back when the work is gone.

Runs the real `LLMEngine` (tiny random model, a 24-block pool so that preemption
happens) under hypothesis' stateful testing.
"""

from __future__ import annotations

import contextlib
import itertools

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
from tests.conftest import make_engine

POOL_BLOCKS = 24
ENGINE = {}
IDS = itertools.count()
"""Request ids stay unique across examples: the engine remembers aborted ones."""


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
        self.engine = engine_for(self.model_dir)
        self.engine.allocator.assert_all_free()
        self.counter = 0
        self.landing: set[str] = set()
        """Imports whose blocks are reserved: a transfer is writing them."""
        self.lent: list[list[int]] = []

    def _new_id(self) -> str:
        self.counter = next(IDS)
        return f"r{self.counter}"

    @rule(
        target=ids,
        prompt_len=st.integers(1, 60),
        max_tokens=st.integers(1, 40),
        prefill_only=st.booleans(),
    )
    def add(self, prompt_len, max_tokens, prefill_only):
        request_id = self._new_id()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [(5 * i + self.counter) % 300 + 3 for i in range(prompt_len)]
        with contextlib.suppress(InvalidRequestError):  # too big for the pool: refused up front
            self.engine.add_request(request_id, prompt, params, stop_after_prefill=prefill_only)
        return request_id

    @rule(target=ids, prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 40))
    def begin_import(self, prompt_len, max_tokens):
        request_id = self._new_id()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [(3 * i + self.counter) % 300 + 3 for i in range(prompt_len)]
        with contextlib.suppress(InvalidRequestError):
            self.engine.begin_import(request_id, prompt, [7], params, prompt_len)
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
    def every_block_has_exactly_one_owner(self):
        if not hasattr(self, "engine"):
            return
        owned = [b for seq in self.engine.sequences.values() for b in seq.block_ids]
        owned += [b for blocks in self.lent for b in blocks]
        allocator = self.engine.allocator
        assert len(owned) == len(set(owned)), "a block has two owners"
        free = set(allocator.free_ids)
        assert not free & set(owned), "a free block is owned"
        assert len(free) + len(owned) == POOL_BLOCKS, "a block is neither free nor owned"
        assert all(allocator.ref_counts[b] == 1 for b in owned)
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
