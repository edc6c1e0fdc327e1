"""Tensor-parallel workers in live clusters (2 ranks, one thread each, on loopback):
greedy output equal to one rank's (transformers' is one rank's, tests/test_tensor_parallel.py),
the ranks' processes listed, KV moved between different splits with the bytes of each
head slice in the receipt, no block or lease left on any rank, and a split the model
cannot take refused before any process starts."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import ray

from cluster.api.frontend import _liveness
from cluster.config import ConfigError
from cluster.flow.cluster import PDCluster
from engine.kv_cache import KVLayout
from engine.model_spec import load_model_spec
from engine.parallel.shard import ModelShard
from engine.sampling_params import SamplingParams
from tests.cluster_helpers import (
    assert_cluster_leak_free,
    collect,
    generate_all,
    mixed_prompts,
    reference_outputs,
    run_cluster,
    tiny_cluster_config,
)
from tests.factories import make_engine

pytestmark = pytest.mark.usefixtures("ray_head")

PROMPTS = mixed_prompts(6)


def test_a_colocated_worker_of_two_ranks_equals_one_rank(tp_model_dirs):
    model_dir = tp_model_dirs["llama_kv2"]
    expected = reference_outputs(model_dir, PROMPTS)
    config = tiny_cluster_config(model_dir, mode="colocated", decode={"tp": 2})

    async def scenario(cluster):
        outputs = await generate_all(cluster, PROMPTS)
        await assert_cluster_leak_free(cluster)
        row = _liveness(cluster.controller.workers["colocated-0"])
        assert row["tp_size"] == 2
        rank0, rank1 = row["rank_pids"]
        assert rank0 == row["pid"] and rank1 != rank0
        assert psutil.Process(rank1).is_running()
        return outputs, row["rank_pids"]

    outputs, pids = run_cluster(config, scenario)
    assert outputs == expected
    assert_gone(pids)


def assert_gone(pids: list[int], wait_s: float = 10.0) -> None:
    """No process of a stopped worker's ranks is left."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def test_prefill_two_ranks_to_decode_one_rank(tp_model_dirs):
    """Decode rank 0 pulls each prefill rank's head, each through a staging pool."""
    _, states = transfer_between_splits(tp_model_dirs["llama_kv2"], 2, 1, "shm")
    assert states["prefill-0"]["rank_leases"] == [[]]  # rank 1 pins nothing either


def test_prefill_one_rank_to_decode_two_ranks_then_a_rank_dies(tp_model_dirs, monkeypatch):
    """Each decode rank pulls the whole blocks and keeps its head. Then, under 8 streams,
    decode rank 1's process is killed: the worker dies as a whole, comes back with both
    ranks, and every stream ends with exactly its reference tokens and text."""
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", "0.02")  # streams outlive the kill
    model_dir = tp_model_dirs["llama_kv2"]
    transfer_between_splits(model_dir, 1, 2, "collective", kill_rank=1)


def transfer_between_splits(
    model_dir, prefill_tp: int, decode_tp: int, transport: str, kill_rank=0
):
    """A prompt sent again finds its blocks in the decode worker's prefix cache (every
    rank's pool holds them) and pulls only the rest. Returns the last request's timings
    and the workers' states."""
    prompts = [*PROMPTS, PROMPTS[-1] + [7, 8]]
    expected = reference_outputs(model_dir, prompts)
    config = tiny_cluster_config(
        model_dir,
        prefill={"tp": prefill_tp},
        decode={"tp": decode_tp},
        transport={"name": transport},
    )

    async def scenario(cluster):
        outputs = await generate_all(cluster, prompts[:-1])
        again, last = await collect(cluster, prompts[-1])
        await assert_cluster_leak_free(cluster)
        states = await cluster.controller.debug_states()
        killed = await kill_under_load(cluster, model_dir, kill_rank) if kill_rank else None
        return [*outputs, again], last.timings, states, killed

    outputs, timings, states, killed = run_cluster(config, scenario)
    assert outputs == expected
    check_slices(model_dir, timings, prefill_tp, transport)
    if killed is not None:
        check_kill(model_dir, *killed)
    return timings, states


def check_slices(model_dir, timings: dict, prefill_tp: int, transport: str) -> None:
    assert timings["transfer_failure"] is None and not timings["recomputed"]
    assert timings["transport"] == transport and timings["decode_reused_blocks"] > 0
    spec = load_model_spec(model_dir)
    sender = KVLayout.for_model(spec, "float32", 8, ModelShard.of(spec, prefill_tp, 0))
    slices = sorted(timings["kv_slices"], key=lambda r: r["first_kv_head"])
    assert len(slices) == 2  # one per head: from prefill rank h (2 -> 1) or to decode rank h
    for head, receipt in enumerate(slices):
        assert receipt["kv_heads"] == 1 and receipt["first_kv_head"] == head
        assert receipt["num_bytes"] == sender.block_nbytes * timings["kv_blocks_moved"]
        assert receipt["staged"] and receipt["checksum"] == "xxh3_64"
        assert receipt["sender_rank" if prefill_tp == 2 else "receiver_rank"] == head
    assert timings["kv_bytes"] == sum(r["num_bytes"] for r in slices)


STREAM = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
STREAM_PROMPTS = [[(7 * i + 3 * j) % 290 + 5 for j in range(5 + 4 * i)] for i in range(8)]


async def kill_under_load(cluster, model_dir, rank: int):
    """8 streams; once every one is flowing, SIGKILL rank `rank` of decode-0."""
    started = [asyncio.Event() for _ in STREAM_PROMPTS]

    async def stream(prompt, flowing):
        tokens, text, last = [], "", None
        async for chunk in cluster.generate(prompt, STREAM):
            tokens += chunk.token_ids
            text += chunk.text
            last = chunk
            if len(tokens) >= 3:
                flowing.set()
        return tokens, text, last.timings

    tasks = [
        asyncio.create_task(stream(p, e)) for p, e in zip(STREAM_PROMPTS, started, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
    worker = cluster.controller.workers["decode-0"]
    before = _liveness(worker)
    held = (await cluster.controller.debug_states())["decode-0"]["requests"]
    os.kill(before["rank_pids"][rank], signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
    deadline = time.monotonic() + 60
    while not (worker.alive and worker.load.rank_pids and worker.generation > before["generation"]):
        assert time.monotonic() < deadline, "decode-0 never came back"
        await asyncio.sleep(0.1)
    await assert_cluster_leak_free(cluster, wait_s=15)
    return before, held, results, _liveness(worker)


def check_kill(model_dir, before: dict, held: dict, results, after: dict) -> None:
    """0 lost, 0 mismatched (tokens and streamed text as one uninterrupted rank makes
    them), the worker back as a new group of ranks, the dead ones gone."""
    reference = make_engine(model_dir).generate(STREAM_PROMPTS, STREAM)
    assert held, "the killed worker held no stream"
    for seq, (tokens, text, _) in zip(reference, results, strict=True):
        assert (tokens, text) == (seq.output_token_ids, seq.output_text)
    affected = [t for _, _, t in results if "decode_died" in t["recoveries"]]
    assert affected, "no stream went through the kill"
    assert after["generation"] == before["generation"] + 1
    assert set(after["rank_pids"]).isdisjoint(before["rank_pids"])  # every rank is new
    assert_gone(before["rank_pids"])


def test_a_split_the_model_cannot_take_starts_nothing(tp_model_dirs):
    """Refused at start-up naming both pools: no worker, no process, no actor on the
    module's Ray head."""
    model_dir = tp_model_dirs["llama_kv2"]  # 8 heads, 2 KV heads
    config = tiny_cluster_config(model_dir, prefill={"tp": 2}, decode={"tp": 3})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match=r"decode.tp=3 cannot serve .* with prefill.tp=2"):
        PDCluster(config)
    named = ray.util.list_named_actors(all_namespaces=True)
    assert not [actor for actor in named if actor["namespace"] == config.namespace]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
