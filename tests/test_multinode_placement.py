"""Two Ray nodes on one machine: one advertises only `prefill_pool`, one only `decode_pool`."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.flow.cluster import PDCluster
from tests.cluster_helpers import (
    assert_cluster_leak_free,
    generate_all,
    mixed_prompts,
    reference_outputs,
    tiny_cluster_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def two_node_cluster():
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"prefill_pool": 2}}
    )
    decode_node = nodes.add_node(num_cpus=1, resources={"decode_pool": 2})
    yield nodes, decode_node
    ray.shutdown()
    nodes.shutdown()


def test_each_actor_lands_on_its_pool_node_and_generation_crosses_nodes(
    tiny_llama_dir, two_node_cluster
):
    nodes, decode_node = two_node_cluster
    prompts = mixed_prompts(4)
    expected = reference_outputs(tiny_llama_dir, prompts)
    # `auto` must pick a cross-node transport here: the nodes are distinct Ray nodes.
    config = tiny_cluster_config(tiny_llama_dir, address=nodes.address, transport="collective")

    async def scenario():
        cluster = await PDCluster(config).start()
        try:
            placement = {
                w.worker_id: (await w.handle.check_health.remote()).node_id
                for w in cluster.controller.workers.values()
            }
            outputs = await generate_all(cluster, prompts)
            await assert_cluster_leak_free(cluster)
            return placement, outputs
        finally:
            await cluster.shutdown()

    placement, outputs = asyncio.run(scenario())

    head_id = nodes.head_node.node_id
    assert placement == {"prefill-0": head_id, "decode-0": decode_node.node_id}
    assert outputs == expected
