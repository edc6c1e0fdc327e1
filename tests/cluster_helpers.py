"""Helpers for tests that start real Ray clusters on loopback."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time

from cluster.config import ClusterConfig
from cluster.flow.cluster import PDCluster
from engine.sampling_params import SamplingParams
from tests.factories import hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
_CLUSTER_NUMBERS = itertools.count()


def tiny_cluster_config(model_dir, **overrides) -> ClusterConfig:
    """A small cluster of the tiny model; `overrides` as `ClusterConfig.replace` takes
    them (a section's as a mapping of its keys: `decode={"workers": 2}`)."""
    settings = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=8,
        prefill={"kv_blocks": 256},
        decode={"kv_blocks": 256},
        prefill_chunk_size=16,
        max_batch_tokens=64,
        threads_per_worker=1,
        health_interval_s=0.5,
        transport={"timeout_s": 20.0},
        # These tests time nothing and wait on many small steps: with the driver sharing
        # the decode worker's core, test_cluster.py took 179 s instead of 124 on 2 cores.
        # Pinning has its own test.
        pin_cores=False,
        # Its own namespace: clusters of a module that share one Ray head (the
        # `ray_head` fixture) never meet a previous cluster's actor names.
        namespace=f"pdserve-test-{next(_CLUSTER_NUMBERS)}",
    )
    return ClusterConfig.from_dict(settings).replace(**overrides)


def mixed_prompts(count: int = 16) -> list[list[int]]:
    """Lengths straddle the block size (8) and the prefill chunk (16)."""
    lengths = [3, 7, 8, 9, 15, 16, 17, 33, 40, 5, 12, 24, 31, 2, 19, 45]
    return [
        [(i * 7 + j * 13) % 300 + 2 for j in range(lengths[i % len(lengths)])] for i in range(count)
    ]


async def collect(cluster: PDCluster, prompt, params=GREEDY) -> tuple[list[int], object]:
    tokens, last = [], None
    async for chunk in cluster.generate(prompt, params):
        tokens += chunk.token_ids
        last = chunk
    return tokens, last


async def generate_all(cluster: PDCluster, prompts, params=GREEDY) -> list[list[int]]:
    results = await asyncio.gather(*(collect(cluster, p, params) for p in prompts))
    return [tokens for tokens, _ in results]


def reference_outputs(model_dir, prompts, max_tokens: int = 12) -> list[list[int]]:
    return [hf_greedy(model_dir, p, max_tokens)[0] for p in prompts]


async def assert_cluster_leak_free(cluster: PDCluster, wait_s: float = 5.0) -> None:
    """Every live worker: no KV block in use, no lease outstanding, no sequence and no
    streamed export or import left."""
    await wait_until_leak_free(cluster.controller.debug_states, wait_s)


async def wait_until_leak_free(debug_states, wait_s: float) -> None:
    """Polls `debug_states()` (worker id -> state) until no worker holds a KV block, a
    lease, a sequence or a stream; acks travel asynchronously, so they get `wait_s` to
    land before the leak is an AssertionError."""
    deadline = time.monotonic() + wait_s
    while True:
        states = await debug_states()
        leaked = {
            worker: state
            for worker, state in states.items()
            if state.get("used_blocks")
            or state.get("outstanding_leases")
            or state.get("sequences")
            or state.get("streams")
        }
        if not leaked:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks, leases or streams leaked: {leaked}")
        await asyncio.sleep(0.05)


def assert_gcs_refuses_strangers(address: str, home) -> None:
    """A Ray GCS client in a fresh process, with no token (and no token file: `home` is
    its home) and then with a wrong one, is refused by the GCS at `address`."""
    code = (
        "from ray._raylet import GcsClient\n"
        f"client = GcsClient(address={address!r})\n"
        "print('answered', client.internal_kv_keys(b'', namespace=None))\n"
    )
    for token in (None, "0" * 64):
        env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
        env.update(HOME=str(home), RAY_AUTH_MODE="token" if token else "disabled")
        if token:
            env["RAY_AUTH_TOKEN"] = token
        answer = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        assert answer.returncode == 1, answer.stdout
        assert "InvalidAuthToken" in answer.stdout, answer.stdout


def run_cluster(config: ClusterConfig, scenario):
    """Start a cluster of `config`, run `await scenario(cluster)` on it, shut it down."""

    async def main():
        cluster = await PDCluster(config).start()
        try:
            return await scenario(cluster)
        finally:
            await cluster.shutdown()

    return asyncio.run(main())
