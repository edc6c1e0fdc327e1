"""A slow reader slows its own stream, never the server's memory: the engine holds a
sequence whose reader is behind, the driver's decode streams ask for that when a
request's queue fills, and the merged stream of a request's choices is bounded."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import ray

from cluster.api.choice_fanout import MAX_QUEUED_CHUNKS, ChoiceFanout
from cluster.flow.decode_streams import HOLD_AT, RESUME_AT, DecodeStreams
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from tests.cluster_helpers import (
    assert_cluster_leak_free,
    collect,
    run_cluster,
    tiny_cluster_config,
)
from tests.factories import assert_no_leaks, hf_greedy, make_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 300 + 3 for i in range(n)]


def finish(engine, steps: int = 500) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(steps):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    raise AssertionError("engine did not go idle")


def reference(tiny_llama_dir, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    engine = make_engine(tiny_llama_dir)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    return finish(engine)


def test_a_held_sequence_makes_no_tokens_keeps_its_kv_and_resumes_exactly(tiny_llama_dir):
    prompts = {"slow": prompt_of(20), "fast": prompt_of(13, salt=5)}
    expected = reference(tiny_llama_dir, prompts)
    engine = make_engine(tiny_llama_dir)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # both prefilled and decoding
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)

    # 1. its reader fell behind: out of every batch from the next step on
    engine.hold("slow", True)
    slow = engine.sequences["slow"]
    held_tokens, held_blocks = len(slow.output_token_ids), list(slow.block_ids)
    for _ in range(5):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert slow.status == SequenceStatus.HELD
    assert len(slow.output_token_ids) == held_tokens
    assert slow.block_ids == held_blocks, "a held sequence keeps its KV"
    assert len(tokens["fast"]) == 8, "the others go on"

    # 2. the reader caught up: it goes on where it stopped, nothing recomputed
    engine.hold("slow", False)
    for request_id, more in finish(engine).items():
        tokens[request_id].extend(more)
    assert tokens == expected
    assert_no_leaks(engine)


def test_a_held_sequence_gives_its_blocks_to_others_and_is_recomputed(tiny_llama_dir):
    prompts = {"slow": prompt_of(30), "next": prompt_of(30, salt=9)}
    expected = reference(tiny_llama_dir, prompts)
    # 8 blocks of 8 tokens hold one 54-token sequence, not two
    engine = make_engine(tiny_llama_dir, num_kv_blocks=8, max_num_seqs=4)
    engine.add_request("slow", prompts["slow"], GREEDY)
    tokens = {"slow": []}
    for _ in range(2):
        for out in engine.step():
            tokens["slow"].extend(out.token_ids)
    engine.hold("slow", True)
    engine.add_request("next", prompts["next"], GREEDY)

    tokens["next"] = finish(engine)["next"]
    slow = engine.sequences["slow"]
    assert slow.status == SequenceStatus.HELD and not slow.block_ids

    engine.hold("slow", False)
    tokens["slow"] += finish(engine)["slow"]
    assert tokens == expected
    assert_no_leaks(engine)


class _Handle:
    """A decode worker's handle: `decode` starts the request, `hold` is recorded, and
    `subscribe` streams whatever batches the test feeds it."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue = asyncio.Queue()
        self.holds: list[tuple[str, bool]] = []
        self.subscribe = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._stream))
        self.decode = SimpleNamespace(remote=self._decode)
        self.hold = SimpleNamespace(remote=lambda rid, behind: self.holds.append((rid, behind)))

    async def _decode(self, request, subscriber) -> None:
        return None

    async def _stream(self, subscriber):
        while True:
            batch = await self.batches.get()
            yield _ready(batch)


async def _ready(value):
    return value


def test_a_full_request_queue_holds_the_request_until_its_reader_catches_up():
    async def scenario() -> None:
        handle = _Handle()
        streams = DecodeStreams()
        worker = SimpleNamespace(worker_id="decode-0", handle=handle)
        events = streams.events(worker, SimpleNamespace(request_id="r"))
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0)
        for step in range(HOLD_AT + 3):  # the reader takes only the first
            handle.batches.put_nowait([("r", step)])
        await asyncio.sleep(0.05)
        assert await first == 0
        assert handle.holds == [("r", True)], "held once, when its queue filled"

        taken = 1
        while handle.holds[-1][1]:
            await events.__anext__()
            taken += 1
        queued = HOLD_AT + 3 - taken
        assert queued == RESUME_AT, "let go on once the reader took it down to RESUME_AT"
        assert handle.holds == [("r", True), ("r", False)]
        await events.aclose()
        streams.close()

    asyncio.run(scenario())


def test_the_merged_stream_of_choices_holds_a_bounded_number_of_chunks():
    produced = []

    async def endless(req):
        for i in range(10 * MAX_QUEUED_CHUNKS):
            produced.append(i)
            yield SimpleNamespace(finished=False, index=i)

    async def scenario() -> None:
        reqs = [SimpleNamespace(close=lambda reason: None)]
        stream = ChoiceFanout(reqs, 1, endless).stream()
        await stream.__anext__()  # starts the choice; then nobody reads
        await asyncio.sleep(0.1)
        assert len(produced) <= MAX_QUEUED_CHUNKS + 2
        async for _ in stream:
            pass
        assert len(produced) == 10 * MAX_QUEUED_CHUNKS

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_stream_nobody_reads_is_held_on_its_decode_worker_and_ends_whole(tiny_llama_dir):
    """Real workers: the driver stops reading a request; its decode worker holds it
    (making no tokens, keeping its KV) while another request is served; read again, it
    ends with every token transformers makes."""
    prompt = [(5 * i) % 300 + 3 for i in range(20)]
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    config = tiny_cluster_config(tiny_llama_dir, transport={"name": "shm"}, max_model_len=512)

    async def held_state(cluster, request_id: str) -> tuple[str, int] | None:
        for state in (await cluster.controller.debug_states()).values():
            if request_id in state.get("requests", {}):
                return state["requests"][request_id], state["tokens_left"][request_id]
        return None

    async def scenario(cluster):
        req = cluster.open_request(prompt, params)
        stream = cluster.run(req)
        tokens = []
        for _ in range(3):  # the first token from prefill, then the decode worker's
            tokens += (await stream.__anext__()).token_ids
        deadline = time.monotonic() + 30
        while (found := await held_state(cluster, req.request_id)) is None or not found[
            0
        ].startswith("held"):
            assert time.monotonic() < deadline, f"never held: {found}"
            await asyncio.sleep(0.1)
        assert found[0] == "held+blocks" and found[1] > 0
        other, _ = await collect(cluster, prompt[:9])
        assert len(other) == 12, "others are served meanwhile"
        assert await held_state(cluster, req.request_id) == found, "held: no new tokens"
        async for chunk in stream:
            tokens += chunk.token_ids
        await assert_cluster_leak_free(cluster)
        return tokens

    try:
        tokens = run_cluster(config, scenario)
    finally:
        ray.shutdown()
    assert tokens == hf_greedy(tiny_llama_dir, prompt, 160)[0]
