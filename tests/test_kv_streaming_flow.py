"""Streamed KV (`kv_streaming: chunk`) on every transport, driven by the real request
flow between a real prefill and decode worker in one process (tests/inprocess_cluster.py):
the tokens equal a whole-prompt transfer's, greedy and sampled, with prefix-cache hits
and with n choices; a cancel mid-stream leaks nothing; bad configs are refused."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.api.choice_fanout import ChoiceFanout
from cluster.config import ClusterConfig, ConfigError
from cluster.flow.disaggregation import (
    DEFAULT_OVERHEAD_S,
    PathInputs,
    exposed_transfer_s,
    predict,
)
from engine.block_manager import blocks_needed
from engine.sampling_params import SamplingParams
from engine.step_costs import StepCosts
from tests.cluster_helpers import tiny_cluster_config
from tests.inprocess_cluster import InProcessCluster
from worker.messages import KVStream

TRANSPORTS = ["shm", "collective", "grpc", "auto"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
PROMPTS = [[(5 * i + 11 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((45, 17, 9, 32))]
"""Lengths across the prefill chunk (16) and block (8): 3 chunks and a partial block,
2 chunks, one chunk, two whole chunks of whole blocks."""
CHUNK, BLOCK = 16, 8
MODES = [
    (KVStream.WHOLE, False),
    (KVStream.PULL, True),
    (KVStream.PUSH, True),
    (KVStream.PUSH, False),
]
"""(how the KV moves, a segment per chunk): whole pull, chunk pull, chunk push, whole push."""


def config_of(model_dir, transport: str) -> ClusterConfig:
    return tiny_cluster_config(
        model_dir, transport={"name": transport, "timeout_s": 20.0}, kv_streaming="chunk"
    )


async def run_mode(cluster: InProcessCluster, stream: KVStream, per_chunk: bool) -> dict:
    """Every prompt twice (the second time both prefix caches hold its full blocks), then
    n=3 sampled choices of the first prompt; salted per mode, so no mode reuses
    another's blocks."""
    cluster.flow.delivery.kv_stream, cluster.flow.delivery.per_chunk = stream, per_chunk
    salt = {"cache_salt": f"mode-{stream}-{per_chunk}"}
    greedy = dataclasses.replace(GREEDY, **salt)
    runs = []
    for repeat in range(2):
        for prompt in PROMPTS:
            tokens, req = await cluster.generate(prompt, greedy)
            runs.append((repeat, prompt, tokens, req.timeline))
    sampled = [
        cluster.open_request(PROMPTS[0], dataclasses.replace(SAMPLED, seed=11 + i, **salt))
        for i in range(3)
    ]
    choices: dict[int, list[int]] = {}
    async for index, chunk in ChoiceFanout(sampled, 3, cluster.run).stream():
        choices.setdefault(index, []).extend(chunk.token_ids)
    return {"runs": runs, "choices": [choices[i] for i in range(3)]}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_streamed_tokens_equal_whole_prompt_transfers(tiny_llama_dir, transport):
    async def main():
        cluster = InProcessCluster(config_of(tiny_llama_dir, transport))
        try:
            results = {mode: await run_mode(cluster, *mode) for mode in MODES}
            await cluster.assert_leak_free()
            return results
        finally:
            await cluster.shutdown()

    results = asyncio.run(main())
    whole = results[MODES[0]]
    for (stream, per_chunk), streamed in list(results.items())[1:]:
        mode = (stream, per_chunk)
        assert [r[2] for r in streamed["runs"]] == [r[2] for r in whole["runs"]], mode
        assert streamed["choices"] == whole["choices"], mode
        assert len({tuple(c) for c in streamed["choices"]}) > 1  # sampled: they differ
        for repeat, prompt, _, timeline in streamed["runs"]:
            breakdown = timeline.breakdown()
            assert breakdown["kv_stream"] == stream.value
            assert timeline.transfer_ok and not timeline.recoveries
            blocks = blocks_needed(len(prompt), BLOCK)
            chunks = -(-len(prompt) // CHUNK)
            if repeat == 0:  # nothing cached: a segment per prefill chunk (push may send
                # two at once, when the second was exported before the first went out)
                segments = breakdown["kv_stream_segments"]
                assert segments == chunks if stream == KVStream.PULL else segments >= 1
                if not per_chunk:
                    assert segments == 1
                assert breakdown["kv_blocks_moved"] == blocks
            else:  # only the blocks the decode worker's cache lacks move
                reused = breakdown["decode_reused_blocks"]
                assert reused == len(prompt) // BLOCK  # every full block: none computed
                assert breakdown["kv_blocks_moved"] == blocks - reused


@pytest.mark.parametrize(("transport", "stream"), [("shm", KVStream.PULL), ("grpc", KVStream.PUSH)])
def test_a_cancel_mid_stream_stops_both_sides_and_leaks_nothing(
    tiny_llama_dir, monkeypatch, transport, stream
):
    # Read by the engines at build; long enough that a loaded machine still sees the
    # stream between its first segment and its last.
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", "0.2")
    prompt = [(3 * j) % 290 + 7 for j in range(64)]  # 4 chunks: ~0.8 s of prefill

    async def main():
        cluster = InProcessCluster(config_of(tiny_llama_dir, transport))
        cluster.flow.delivery.kv_stream = stream
        try:
            task = asyncio.ensure_future(cluster.generate(prompt, GREEDY))
            imported = await _first_segment_landed(cluster, task)
            prefilling = (await cluster.prefill.debug_state())["requests"]
            landed, total = imported.landed, blocks_needed(len(prompt), BLOCK)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await cluster.assert_leak_free()
            return landed, total, prefilling
        finally:
            await cluster.shutdown()

    landed, total, prefilling = asyncio.run(main())
    # It struck mid-stream: some blocks had landed, not all; the prompt still computed.
    assert 0 < landed < total
    assert list(prefilling.values()) == ["running+blocks"]


async def _first_segment_landed(cluster: InProcessCluster, request, timeout_s: float = 20.0):
    """The decode side's import once its first streamed segment landed, while `request`
    (the generate task) still runs."""

    async def landed():
        while not request.done():
            for imported in list(cluster.decode.streamed.values()):
                if imported.landed > 0:
                    return imported
            await asyncio.sleep(0.002)
        raise AssertionError("the request ended before a landed segment was seen")

    return await asyncio.wait_for(landed(), timeout_s)


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"mode": "colocated", "transport": {"name": "local"}}, "mode: disaggregated"),
        ({"disaggregation": "never"}, "no KV ever moves"),
        ({"decode": {"tp": 2}}, "tensor-parallel workers move whole prompts"),
    ],
)
def test_a_config_that_cannot_stream_is_refused_at_start(changes, refusal):
    with pytest.raises(ConfigError, match=refusal):
        ClusterConfig().replace(kv_streaming="chunk", **changes)
    with pytest.raises(ConfigError, match=refusal):
        ClusterConfig().replace(kv_transfer_mode="push", **changes)
    assert ClusterConfig().replace(**changes).kv_stream == KVStream.WHOLE  # whole: as before


def test_auto_prices_a_streamed_transfer_at_what_the_prefill_does_not_hide():
    """`disaggregation: auto` with `kv_streaming: chunk`: the remote path pays only the
    exposed transfer, so it wins at slower links than with whole-prompt transfers."""
    costs = StepCosts(prefill_fixed_s=0.01, prefill_token_s=0.001)
    inputs = PathInputs(
        prompt_tokens=2048,
        block_size=16,
        block_bytes=368_640,
        prefill_costs=costs,
        decode_costs=None,
        bandwidth=20e6,
        prefill_chunk=512,
    )
    whole, _, _ = predict(inputs)
    streamed, _, _ = predict(dataclasses.replace(inputs, streamed=True))
    compute = 4 * 0.01 + 2048 * 0.001
    transfer = 128 * 368_640 / 20e6
    assert whole == pytest.approx(compute + DEFAULT_OVERHEAD_S + transfer)
    assert streamed == pytest.approx(
        compute + DEFAULT_OVERHEAD_S + exposed_transfer_s(compute, transfer, 4)
    )
    assert exposed_transfer_s(4.0, 2.0, 4) == pytest.approx(0.5)  # the last chunk's share
    assert exposed_transfer_s(1.0, 8.0, 4) == pytest.approx(7.25)  # link-bound
    assert exposed_transfer_s(1.0, 3.0, 1) == pytest.approx(3.0)  # one chunk: all of it
