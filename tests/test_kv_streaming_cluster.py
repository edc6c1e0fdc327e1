"""Streamed KV on a real cluster (Ray, separate worker processes, shm): a transfer that is
provably overlapped with the prompt's compute, and a prefill worker killed mid-stream
that loses no request and leaks nothing.

One cluster for both: slowed steps (`PDSERVE_STEP_DELAY_S`) and a link capped so that
one prefill chunk's blocks take about as long to move as the chunk takes to compute.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cluster.flow.cluster import PDCluster
from engine.sampling_params import SamplingParams
from tests.cluster_helpers import assert_cluster_leak_free, reference_outputs, tiny_cluster_config
from worker.messages import KVStream

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_head")]

STEP_DELAY_S = 0.05
BLOCK_BYTES = 2 * 3 * 3 * 16 * 8 * 4
"""The tiny Llama's KV block: K and V x 3 layers x 3 KV heads x 16 dims x 8 tokens x fp32."""
CHUNK_BLOCKS = 2  # a 16-token chunk
CAP = CHUNK_BLOCKS * BLOCK_BYTES / STEP_DELAY_S
"""Bytes/s at which one chunk's blocks take one (slowed) chunk step to move."""
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG_PROMPT = [(7 * j) % 290 + 5 for j in range(64)]  # 4 chunks, 8 blocks
WAVE = [[(5 * i + 3 * j) % 290 + 5 for j in range(72 + 8 * i)] for i in range(4)]
"""Prompts of 5-8 chunks, prefilled one after another on one prefill worker."""


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return reference_outputs(tiny_llama_dir, [LONG_PROMPT, *WAVE], PARAMS.max_tokens)


def test_streamed_transfer_overlaps_compute_and_survives_a_prefill_death(
    tiny_llama_dir, expected, monkeypatch
):
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", str(STEP_DELAY_S))  # inherited by the workers
    config = tiny_cluster_config(
        tiny_llama_dir,
        transport={"name": "shm", "bandwidth_bytes_per_s": CAP, "timeout_s": 20.0},
        kv_streaming="chunk",
        first_token_from="decode",
        prefix_caching=False,  # the restarted worker's retries must compute, not hit
    )
    closed = []

    async def main():
        cluster = await PDCluster(config).start()
        cluster.on_finish.append(closed.append)
        try:
            overlap = [await one_streamed_request(cluster, stream) for stream in KVStream]
            cluster.flow.delivery.kv_stream = KVStream.PULL
            killed = await kill_prefill_mid_stream(cluster)
            await assert_cluster_leak_free(cluster, wait_s=15)
            after = await collect(cluster, LONG_PROMPT)
            await assert_cluster_leak_free(cluster, wait_s=15)
            return overlap, killed, after
        finally:
            await cluster.shutdown()

    overlap, (results, held), (after, _) = asyncio.run(main())
    whole, *streamed = overlap
    assert all(tokens == expected[0] for tokens, *_ in overlap)
    assert whole[1] is None  # a whole-prompt transfer: nothing hidden, all exposed
    for stream, (_, receipt, last_chunk_end, timings) in zip(
        [KVStream.PULL, KVStream.PUSH], streamed, strict=True
    ):
        # Chunk 1's blocks were on the decode worker before the prompt's last chunk ended
        # (one node: both workers' monotonic clocks are the machine's), and the receipt
        # proves it on the decode worker's clock alone: they landed before the final
        # segment arrived.
        assert receipt.first_landed_at < last_chunk_end, stream
        assert receipt.first_landed_before_final_s > 0, stream
        assert receipt.hidden_s > 0 and receipt.segments == 4, (stream, receipt)
        assert timings["kv_transfer_exposed_s"] < timings["kv_transfer_s"], timings
        print(
            f"\n{stream}: chunk 1 landed {1000 * (last_chunk_end - receipt.first_landed_at):.0f}"
            f" ms before the last chunk ended; hidden {1000 * receipt.hidden_s:.0f} ms, "
            f"exposed {1000 * receipt.exposed_s:.0f} ms; TTFT {1000 * timings['ttft_s']:.0f} ms"
            f" (whole: {1000 * whole[3]['ttft_s']:.0f} ms)"
        )
    # The kill struck mid-stream: the dead worker held streamed exports in flight.
    assert held, "the kill found no stream in flight"
    assert [tokens for tokens, _ in results] == expected[1:]
    cut = [t for _, t in results if "stream_kept" in t["recovery_paths"]]
    assert cut, "no request went through the cut"
    assert any(t.get("kv_stream_kept_blocks", 0) > 0 for t in cut), cut
    assert all("prefill_died" in t["recoveries"] for t in cut)
    assert after == expected[0]


async def collect(cluster, prompt):
    tokens, last = [], None
    async for chunk in cluster.generate(prompt, PARAMS):
        tokens += chunk.token_ids
        last = chunk
    return tokens, last.timings


async def one_streamed_request(cluster, stream: KVStream):
    """(tokens, the import's stream receipt, when the prefill's last chunk step ended,
    the timings) of `LONG_PROMPT` with its KV moved as `stream` says."""
    cluster.flow.delivery.kv_stream = stream
    closed = []
    cluster.on_finish.append(closed.append)
    tokens, timings = await collect(cluster, LONG_PROMPT)
    cluster.on_finish.remove(closed.append)
    assert timings["kv_stream"] == stream.value and not timings["recoveries"], timings
    receipt = closed[0].timeline.imported.stream
    steps = await cluster.controller.workers["prefill-0"].handle.steps.remote(4)
    chunks = [s for s in steps if s["prefill_tokens"] > 0]
    assert [s["prefill_tokens"] for s in chunks] == [16, 16, 16, 16]
    return tokens, receipt, chunks[-1]["started"] + chunks[-1]["seconds"], timings


async def kill_prefill_mid_stream(cluster):
    """Send the wave, SIGKILL the prefill worker once it holds streamed exports of which
    some segments went out, and collect every request; returns the results and what the
    worker was streaming when it died."""
    prefill = cluster.controller.workers["prefill-0"]
    pid = (await prefill.handle.check_health.remote()).pid
    tasks = [asyncio.create_task(collect(cluster, p)) for p in WAVE]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = await prefill.handle.debug_state.remote()
        streaming = {rid: n for rid, n in state["streams"].items() if n > 0}
        if streaming and state["leases"]:
            os.kill(pid, signal.SIGKILL)
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the prefill worker never streamed a segment")
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    while not prefill.alive or prefill.generation == 0:
        await asyncio.sleep(0.1)
    return results, streaming
