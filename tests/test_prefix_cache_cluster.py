"""Prefix caching across a real disaggregated cluster (Ray actors, shm on loopback):
repeat prefixes go to the decode worker that holds them and move only their missing
blocks, a conversation's next turn finds its history there, the decode worker can
prefill instead, and every output equals transformers'."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.flow.cluster import PDCluster
from engine.block_manager import blocks_needed
from tests.cluster_helpers import GREEDY, assert_cluster_leak_free, collect, tiny_cluster_config
from tests.factories import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_head")]
BLOCK = 8


def tokens(n: int, salt: int) -> list[int]:
    return [(11 * i + 37 * salt) % 300 + 2 for i in range(n)]


PREFIX = tokens(40, salt=1)  # 5 whole blocks


def test_prefix_reuse_end_to_end(tiny_llama_dir):
    config = tiny_cluster_config(
        tiny_llama_dir,
        transport={"name": "shm"},
        decode={"workers": 2},
        router_policy="cache_aware",
        block_size=BLOCK,
    )

    async def scenario():
        async with PDCluster(config) as cluster:
            await _scenario(cluster, tiny_llama_dir)

    asyncio.run(scenario())


async def _scenario(cluster: PDCluster, model_dir) -> None:
    # 1. a first prompt: computed and moved whole
    first = PREFIX + tokens(5, salt=2)
    out1, last1 = await collect(cluster, first)
    t1 = last1.timings
    assert out1 == hf_greedy(model_dir, first, 12)[0]
    assert (t1["cached_tokens"], t1["decode_reused_blocks"]) == (0, 0)
    assert t1["kv_blocks_moved"] == blocks_needed(len(first), BLOCK)
    block_bytes = t1["kv_bytes"] // t1["kv_blocks_moved"]

    # 2. the same prefix: prefilled from the prefill worker's cache, sent to the decode
    #    worker holding it, which pulls only the missing blocks
    second = PREFIX + tokens(6, salt=3)
    out2, last2 = await collect(cluster, second)
    t2 = last2.timings
    assert out2 == hf_greedy(model_dir, second, 12)[0]
    assert t2["decode_worker"] == t1["decode_worker"]
    assert t2["route"]["decode"]["reason"] == "cache"
    assert (t2["cached_tokens"], t2["prefill_cached_tokens"]) == (40, 40)
    assert t2["decode_reused_blocks"] == 5
    assert t2["kv_blocks_moved"] == blocks_needed(len(second), BLOCK) - 5
    assert t2["kv_bytes"] == t2["kv_blocks_moved"] * block_bytes
    assert t2["kv_bytes_saved"] == 5 * block_bytes

    # 2b. the same prompt under a cache salt: no worker's cache serves it, the output
    #     is the same
    salted = dataclasses.replace(GREEDY, cache_salt="tenant-a")
    out2b, last2b = await collect(cluster, second, salted)
    t2b = last2b.timings
    assert out2b == out2
    assert (t2b["cached_tokens"], t2b["prefill_cached_tokens"]) == (0, 0)
    assert t2b["decode_reused_blocks"] == 0
    assert t2b["kv_blocks_moved"] == blocks_needed(len(second), BLOCK)

    # 3. the next turn of the first conversation: its history (prompt + outputs) is on
    #    its decode worker, which receives only the blocks of the new tokens
    turn2 = first + out1 + tokens(7, salt=4)
    out3, last3 = await collect(cluster, turn2)
    t3 = last3.timings
    assert out3 == hf_greedy(model_dir, turn2, 12)[0]
    assert t3["decode_worker"] == t1["decode_worker"]
    held = (len(first) + len(out1) - 1) // BLOCK  # the last output's KV was never computed
    assert t3["decode_reused_blocks"] == held
    assert t3["prefill_cached_tokens"] == len(first) // BLOCK * BLOCK

    # 4. `never`: the decode worker prefills from its own cache; nothing moves
    cluster.flow.disaggregation.mode = "never"
    fourth = PREFIX + tokens(9, salt=5)
    out4, last4 = await collect(cluster, fourth)
    t4 = last4.timings
    assert out4 == hf_greedy(model_dir, fourth, 12)[0]
    assert t4["disaggregation"]["path"] == "local" and t4["prefill_worker"] is None
    assert (t4["kv_bytes"], t4["cached_tokens"]) == (0, 40)

    # 5. `auto` decides per request from what was measured, and says so
    cluster.flow.disaggregation.mode = "auto"
    await asyncio.sleep(2 * cluster.config.health_interval_s)  # fresh step costs
    fifth = PREFIX + tokens(4, salt=6)
    out5, last5 = await collect(cluster, fifth)
    choice = last5.timings["disaggregation"]
    assert out5 == hf_greedy(model_dir, fifth, 12)[0]
    assert choice["reason"] == "cheaper" and choice["path"] in ("local", "remote")
    assert choice["remote_s"] > 0 and choice["local_s"] > 0

    await assert_cluster_leak_free(cluster)
    cached = {w: info.load.prefix_cache for w, info in cluster.controller.workers.items()}
    assert cached["prefill-0"].hit_tokens > 0  # what the router saw in health reports
    assert cached[t1["decode_worker"]].cached_blocks >= held
