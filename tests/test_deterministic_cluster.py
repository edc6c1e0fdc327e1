"""Deterministic mode on a live cluster (1 prefill + 2 decode workers, real processes):
8 seeded streams at temperature 0.8 give the same tokens, text and logprobs one at a
time, all at once, mixed with 8 unrelated greedy streams, and with a decode worker
killed mid-stream (their streams migrate and continue from the same seeds).

Logprobs are compared exactly: they are the logits' bits as the client sees them, so a
difference in any row's last bit fails the test even where the drawn token survives it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from cluster.flow.cluster import PDCluster
from engine.sampling_params import SamplingParams
from tests.cluster_helpers import assert_cluster_leak_free, tiny_cluster_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_head")]

LENGTHS = [5, 13, 30, 47, 70, 96, 140, 21]
PROMPTS = [[(11 * i + 5 * j) % 290 + 5 for j in range(n)] for i, n in enumerate(LENGTHS)]
SEEDED = [
    SamplingParams(max_tokens=36, temperature=0.8, seed=40 + i, ignore_eos=True, logprobs=1)
    for i in range(len(PROMPTS))
]
GREEDY_PROMPTS = [[(3 * i + 7 * j) % 290 + 5 for j in range(9 + 6 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)


async def stream(cluster, prompt, params, flowing: asyncio.Event | None = None):
    """(token ids, text, logprobs, timings) of one streamed request; `flowing` is set
    after its third chunk."""
    tokens, text, logprobs, chunks, last = [], "", [], 0, None
    async for chunk in cluster.generate(prompt, params):
        tokens += chunk.token_ids
        text += chunk.text
        logprobs += chunk.logprobs or []
        chunks += 1
        last = chunk
        if flowing is not None and chunks == 3:
            flowing.set()
    return tokens, text, logprobs, last.timings


def outputs(results) -> list[tuple]:
    return [(tokens, text, logprobs) for tokens, text, logprobs, _ in results]


async def one_at_a_time(cluster):
    return [await stream(cluster, p, s) for p, s in zip(PROMPTS, SEEDED, strict=True)]


async def all_at_once(cluster, extra=()):
    seeded = [stream(cluster, p, s) for p, s in zip(PROMPTS, SEEDED, strict=True)]
    greedy = [stream(cluster, p, GREEDY) for p in extra]
    results = await asyncio.gather(*seeded, *greedy)
    return results[: len(PROMPTS)]


async def with_a_decode_worker_killed(cluster):
    """All seeded streams (and the greedy ones, to keep both decode workers busy); once
    each seeded stream flows, SIGKILL a decode worker that holds some of them."""
    events = [asyncio.Event() for _ in PROMPTS]
    seeded = [
        asyncio.create_task(stream(cluster, p, s, e))
        for p, s, e in zip(PROMPTS, SEEDED, events, strict=True)
    ]
    greedy = [asyncio.create_task(stream(cluster, p, GREEDY)) for p in GREEDY_PROMPTS]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=120)
    states = await cluster.controller.debug_states()
    victim = max(("decode-0", "decode-1"), key=lambda w: len(states[w].get("requests", {})))
    assert states[victim].get("requests"), f"{victim} held no stream to migrate"
    health = await cluster.controller.workers[victim].handle.check_health.remote()
    os.kill(health.pid, signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*seeded), timeout=240)
    await asyncio.wait_for(asyncio.gather(*greedy), timeout=240)
    return results


def test_seeded_streams_are_the_same_in_any_batch_and_after_a_decode_worker_dies(
    tiny_llama_dir, monkeypatch
):
    # Steps slow enough that the kill finds the streams mid-way (inherited by the workers).
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", "0.03")
    config = tiny_cluster_config(
        tiny_llama_dir, deterministic=True, prefill={"workers": 1}, decode={"workers": 2}
    )

    async def main():
        cluster = await PDCluster(config).start()
        try:
            runs = {"alone": await one_at_a_time(cluster)}
            runs["together"] = await all_at_once(cluster)
            runs["among greedy"] = await all_at_once(cluster, GREEDY_PROMPTS)
            runs["decode worker killed"] = await with_a_decode_worker_killed(cluster)
            await assert_cluster_leak_free(cluster, wait_s=15)
            return runs
        finally:
            await cluster.shutdown()

    runs = asyncio.run(main())
    alone = outputs(runs["alone"])
    assert all(len(tokens) == 36 for tokens, _, _ in alone)
    for name, results in runs.items():
        assert outputs(results) == alone, name
    migrated = [t for *_, t in runs["decode worker killed"] if "decode_died" in t["recoveries"]]
    assert migrated, "no seeded stream went through the kill"
