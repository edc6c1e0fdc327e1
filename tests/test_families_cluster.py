"""Each new family through a cluster, disaggregated, the three transports shared out
among the families: greedy outputs equal transformers' (prompts past the window and a
prefill chunk), a repeated prefix is served from the prefix cache, logprobs equal
transformers', seeded sampled choices under a grammar (what the frontend's `n` sends:
seed, seed + 1, ...) equal one engine's, and no block or lease is left behind.

The disaggregated runs use the in-process cluster (tests/inprocess_cluster.py: the real
workers, transports and request flow, without Ray's start), where what differs between
families lives; one family runs colocated and two have a decode worker killed
mid-stream on a real Ray cluster, whose paths are the same code for every family.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest
import torch

from cluster.flow.cluster import PDCluster
from engine.sampling_params import SamplingParams, StructuredSpec
from tests.cluster_helpers import assert_cluster_leak_free, collect, tiny_cluster_config
from tests.factories import NEW_FAMILIES, _hf_model, hf_greedy, make_engine
from tests.inprocess_cluster import InProcessCluster

pytestmark = pytest.mark.slow

TRANSPORT = {
    "qwen3": "shm",
    "gemma2": "grpc",
    "gemma3": "collective",
    "phi3": "shm",
    "mixtral": "grpc",
    "qwen3_moe": "collective",
    "mistral_window": "shm",
}
"""The transport each family's disaggregated run moves its KV over."""
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(
    max_tokens=16, temperature=0.9, seed=41, structured=StructuredSpec("regex", "[a-z ]{10}")
)
CHOICES = 3
TOLERANCE = 1e-4


def tokens(n: int, salt: int) -> list[int]:
    return [(11 * i + 37 * salt) % 300 + 2 for i in range(n)]


PROMPTS = [tokens(n, salt) for salt, n in enumerate((5, 17, 30, 41))]
PREFIX = tokens(40, salt=9)


def _choice(index: int) -> SamplingParams:
    return dataclasses.replace(SAMPLED, seed=SAMPLED.seed + index)


KILLED = ("mistral_window", "qwen3_moe")
"""Families whose decode worker is killed mid-stream: one that has freed blocks by then
(window), one with experts; the recovery path is the same code for every family."""


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_family_disaggregated(family_model_dirs, family):
    model_dir = family_model_dirs[family]
    config = tiny_cluster_config(model_dir, transport={"name": TRANSPORT[family]})

    async def scenario():
        cluster = InProcessCluster(config)
        try:
            results = await _serve_each_kind(cluster.chunks_view())
            await cluster.assert_leak_free()
            return results
        finally:
            await cluster.shutdown()

    _assert_each_kind(model_dir, asyncio.run(scenario()))


@pytest.mark.usefixtures("ray_head")
def test_experts_colocated_on_a_ray_cluster(family_model_dirs):
    model_dir = family_model_dirs["mixtral"]
    config = tiny_cluster_config(model_dir, mode="colocated", transport={"name": "local"})

    async def scenario():
        async with PDCluster(config) as cluster:
            results = await _serve_each_kind(cluster)
            await assert_cluster_leak_free(cluster)
            return results

    _assert_each_kind(model_dir, asyncio.run(scenario()))


async def _serve_each_kind(cluster):
    """Greedy prompts at once, a repeated prefix, logprobs, seeded choices."""
    greedy = await asyncio.gather(*(collect(cluster, p, GREEDY) for p in PROMPTS))
    first, _ = await collect(cluster, [*PREFIX, 3], GREEDY)
    second, repeated = await collect(cluster, [*PREFIX, 4, 5], GREEDY)
    logprobs = [c async for c in cluster.generate(PROMPTS[3], LOGPROBS)]
    choices = await asyncio.gather(
        *(collect(cluster, PROMPTS[1], _choice(i)) for i in range(CHOICES))
    )
    return greedy, (first, second, repeated.timings), logprobs, choices


def _assert_each_kind(model_dir, results) -> None:
    greedy, (first, second, timings), logprobs, choices = results
    assert [out for out, _ in greedy] == [hf_greedy(model_dir, p, 12)[0] for p in PROMPTS]
    assert first == hf_greedy(model_dir, [*PREFIX, 3], 12)[0]
    assert second == hf_greedy(model_dir, [*PREFIX, 4, 5], 12)[0]
    assert timings["cached_tokens"] == 40, timings
    _assert_logprobs_equal_transformers(model_dir, PROMPTS[3], logprobs)
    engine = make_engine(model_dir, prefill_chunk_size=16, max_batch_tokens=64)
    for index, (out, _) in enumerate(choices):
        expected = engine.generate([PROMPTS[1]], _choice(index))[0]
        assert out == expected.output_token_ids
    assert len({tuple(out) for out, _ in choices}) > 1  # the seeds differ


def _assert_logprobs_equal_transformers(model_dir, prompt, chunks) -> None:
    output = [t for c in chunks for t in c.token_ids]
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt + output])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    entries = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == output
    for step, entry in enumerate(entries):
        row = reference[len(prompt) - 1 + step]
        assert abs(entry.logprob - row[entry.token_id].item()) < TOLERANCE
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()


MIGRATING = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.mark.usefixtures("ray_head")
@pytest.mark.parametrize("family", KILLED)
def test_a_decode_kill_mid_stream_loses_nothing(family_model_dirs, family, monkeypatch):
    """The stream's decode worker is killed after 12 tokens (past the window: a windowed
    family has freed blocks by then); the stream resumes elsewhere and its tokens are
    transformers'."""
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", "0.03")  # inherited by the Ray workers
    model_dir = family_model_dirs[family]
    prompt = tokens(30, salt=21)
    config = tiny_cluster_config(
        model_dir,
        transport={"name": TRANSPORT[family]},
        decode={"workers": 2},
        recovery_timeout_s=60.0,
    )

    async def scenario():
        async with PDCluster(config) as cluster:
            request_id, out, killed = f"migrating-{family}", [], None
            async for chunk in cluster.generate(prompt, MIGRATING, request_id=request_id):
                out += chunk.token_ids
                if len(out) >= 12 and killed is None:
                    killed = await _decode_holder(cluster, request_id)
                    health = await cluster.controller.workers[killed].handle.check_health.remote()
                    os.kill(health.pid, signal.SIGKILL)
            await assert_cluster_leak_free(cluster, wait_s=15)
            return out, killed, chunk.timings

    out, killed, timings = asyncio.run(scenario())
    assert killed is not None and "decode_died" in str(timings)
    assert out == hf_greedy(model_dir, prompt, 48)[0]


async def _decode_holder(cluster, request_id: str) -> str | None:
    states = await cluster.controller.debug_states()
    for worker_id, state in states.items():
        if worker_id.startswith("decode") and request_id in state.get("requests", {}):
            return worker_id
    return None
