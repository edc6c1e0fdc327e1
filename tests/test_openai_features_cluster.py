"""Logprobs in a colocated cluster, and a seeded sampled stream with penalties and a
grammar that survives a decode worker's death exactly (real Ray workers)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from cluster.flow.cluster import PDCluster
from engine.sampling_params import SamplingParams, StructuredSpec
from tests.cluster_helpers import assert_cluster_leak_free, tiny_cluster_config
from tests.factories import _hf_model, make_engine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_head")]

TOLERANCE = 1e-4


def test_colocated_prompt_and_output_logprobs_equal_transformers(tiny_llama_dir):
    prompt = [(5 * i) % 290 + 4 for i in range(21)]
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )

    async def main():
        async with PDCluster(tiny_cluster_config(tiny_llama_dir, mode="colocated")) as cluster:
            chunks = [c async for c in cluster.generate(prompt, params)]
            await assert_cluster_leak_free(cluster)
            return chunks

    chunks = asyncio.run(main())
    tokens = [t for c in chunks for t in c.token_ids]
    with torch.no_grad():
        logits = _hf_model(str(tiny_llama_dir))(torch.tensor([prompt + tokens])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    prompt_entries = chunks[0].prompt_logprobs
    assert prompt_entries[0] is None and len(prompt_entries) == len(prompt)
    for position, entry in enumerate(prompt_entries[1:], start=1):
        assert abs(entry.logprob - reference[position - 1, prompt[position]].item()) < TOLERANCE
    entries = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == tokens
    for step, entry in enumerate(entries):
        row = reference[len(prompt) - 1 + step]
        assert abs(entry.logprob - row[entry.token_id].item()) < TOLERANCE
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()


MIGRATING = SamplingParams(
    max_tokens=70,
    temperature=1.0,
    top_p=0.9,
    seed=23,
    presence_penalty=0.5,
    frequency_penalty=0.7,
    repetition_penalty=1.2,
    structured=StructuredSpec("regex", "[a-z ]{64}"),
    logprobs=1,
)


async def _decode_holder(cluster, request_id: str) -> str | None:
    states = await cluster.controller.debug_states()
    for worker_id, state in states.items():
        if worker_id.startswith("decode") and request_id in state.get("requests", {}):
            return worker_id
    return None


def test_seeded_sampled_stream_with_penalties_and_grammar_survives_decode_migration(
    tiny_llama_dir, monkeypatch
):
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", "0.03")  # inherited by the Ray workers
    prompt = [(3 * i) % 290 + 7 for i in range(26)]
    config = tiny_cluster_config(tiny_llama_dir, decode={"workers": 2}, recovery_timeout_s=60.0)

    async def main():
        async with PDCluster(config) as cluster:
            request_id, tokens, text, killed = "migrating-0", [], "", None
            async for chunk in cluster.generate(prompt, MIGRATING, request_id=request_id):
                tokens += chunk.token_ids
                text += chunk.text
                if len(tokens) >= 12 and killed is None:
                    killed = await _decode_holder(cluster, request_id)
                    pid = (
                        await cluster.controller.workers[killed].handle.check_health.remote()
                    ).pid
                    os.kill(pid, signal.SIGKILL)
            await assert_cluster_leak_free(cluster, wait_s=15)
            return tokens, text, killed, chunk.timings

    tokens, text, killed, timings = asyncio.run(main())
    expected = make_engine(tiny_llama_dir).generate([prompt], MIGRATING)[0]
    assert killed is not None and "decode_died" in str(timings)
    assert tokens == expected.output_token_ids
    assert text == expected.output_text and len(text) == 64
