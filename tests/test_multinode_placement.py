"""Two Ray nodes on one machine: one advertises only `prefill_pool`, one only `decode_pool`."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.control.ray_access import AUTH_MODE_ENV, AUTH_TOKEN_ENV, reload_auth_settings
from cluster.flow.cluster import PDCluster
from tests.cluster_helpers import (
    assert_cluster_leak_free,
    assert_gcs_refuses_strangers,
    generate_all,
    mixed_prompts,
    reference_outputs,
    tiny_cluster_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(params=["disabled", "token"], ids=["no-auth", "token-auth"])
def two_node_cluster(request):
    """Both nodes, and the driver that joins them, in one Ray auth mode, as an operator
    sets it with `RAY_AUTH_MODE` (and `RAY_AUTH_TOKEN`) on every node."""
    if ray.is_initialized():
        ray.shutdown()
    saved = {name: os.environ.get(name) for name in (AUTH_MODE_ENV, AUTH_TOKEN_ENV)}
    os.environ[AUTH_MODE_ENV] = request.param
    os.environ[AUTH_TOKEN_ENV] = secrets.token_hex(32)
    reload_auth_settings()
    try:
        nodes = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"prefill_pool": 2}}
        )
        decode_node = nodes.add_node(num_cpus=1, resources={"decode_pool": 2})
        yield nodes, decode_node, request.param
        ray.shutdown()
        nodes.shutdown()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reload_auth_settings()


def test_each_actor_lands_on_its_pool_node_and_generation_crosses_nodes(
    tiny_llama_dir, two_node_cluster, caplog, tmp_path
):
    """Also: a cluster that requires Ray's token (and refuses a caller without it) serves
    as one that does not, and joining one that does not gets the warning."""
    nodes, decode_node, auth_mode = two_node_cluster
    if auth_mode == "token":
        assert_gcs_refuses_strangers(nodes.address, tmp_path)
    prompts = mixed_prompts(4)
    expected = reference_outputs(tiny_llama_dir, prompts)
    # `auto` must pick a cross-node transport here: the nodes are distinct Ray nodes.
    config = tiny_cluster_config(
        tiny_llama_dir, address=nodes.address, transport={"name": "collective"}
    )

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
    warned = [r.getMessage() for r in caplog.records if "requires no token" in r.getMessage()]
    assert len(warned) == (auth_mode == "disabled"), warned
