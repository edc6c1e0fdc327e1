"""Real Ray actors on loopback: disaggregated == colocated == transformers."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import ray

from cluster.control.local_head import local_head_pids
from engine.cpu_affinity import BOOT_CORES_ENV, pinning_supported, process_cores
from engine.native.ops import native_kernels
from tests.cluster_helpers import (
    GREEDY,
    assert_cluster_leak_free,
    collect,
    generate_all,
    mixed_prompts,
    reference_outputs,
    run_cluster,
    tiny_cluster_config,
)
from tests.factories import make_engine
from tests.inprocess_cluster import InProcessCluster

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_head")]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    prompts = mixed_prompts(16)
    return prompts, reference_outputs(tiny_llama_dir, prompts)


@pytest.mark.parametrize("mode,transport", [("colocated", "local"), ("disaggregated", "shm")])
def test_16_concurrent_greedy_requests_match_transformers(
    tiny_llama_dir, reference, mode, transport
):
    prompts, expected = reference
    config = tiny_cluster_config(tiny_llama_dir, mode=mode, transport={"name": transport})

    async def scenario(cluster):
        outputs = await generate_all(cluster, prompts)
        await assert_cluster_leak_free(cluster)
        return outputs

    assert run_cluster(config, scenario) == expected


@pytest.mark.parametrize("transport", ["collective", "grpc"])
def test_16_concurrent_greedy_requests_over_each_transport_in_process(
    tiny_llama_dir, reference, transport
):
    """The other transports between the real workers without Ray (tests/inprocess_cluster.py):
    what Ray adds is the same for every transport."""
    prompts, expected = reference
    config = tiny_cluster_config(tiny_llama_dir, transport={"name": transport})
    assert asyncio.run(_in_process(config, prompts)) == expected


@pytest.mark.skipif(native_kernels() is None, reason="a bf16 pool under float32 needs the kernels")
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_bf16_kv_pool_crosses_each_transport_unchanged(tiny_llama_dir, transport):
    """bf16 blocks (half a float32 block's bytes) move between workers and decode to what
    one engine over the same kind of pool makes, token for token."""
    prompts = mixed_prompts(6)
    config = tiny_cluster_config(
        tiny_llama_dir, transport={"name": transport}, kv_cache_dtype="bfloat16"
    )
    engine = make_engine(
        tiny_llama_dir, kv_cache_dtype="bfloat16", prefill_chunk_size=16, max_batch_tokens=64
    )
    expected = [seq.output_token_ids for seq in engine.generate(prompts, GREEDY)]
    assert asyncio.run(_in_process(config, prompts)) == expected


async def _in_process(config, prompts) -> list[list[int]]:
    """`prompts` at once through an in-process cluster of `config`, checked leak-free."""
    cluster = InProcessCluster(config)
    try:
        outputs = await generate_all(cluster.chunks_view(), prompts)
        await cluster.assert_leak_free()
        return outputs
    finally:
        await cluster.shutdown()


def test_more_requests_than_the_decode_pool_holds_all_complete(tiny_llama_dir, reference):
    prompts, expected = reference
    # 10 blocks of 8 tokens: room for two or three sequences at a time, 16 arrive at once.
    config = tiny_cluster_config(
        tiny_llama_dir, transport={"name": "shm"}, decode={"kv_blocks": 10}, max_model_len=80
    )
    assert asyncio.run(_in_process(config, prompts)) == expected


def test_workers_use_the_configured_thread_count_and_report_timings(tiny_llama_dir, reference):
    prompts, _ = reference
    config = tiny_cluster_config(tiny_llama_dir, transport={"name": "shm"}, threads_per_worker=1)

    async def scenario(cluster):
        loads = [await w.handle.check_health.remote() for w in cluster.controller.workers.values()]
        from tests.cluster_helpers import collect

        _, last = await collect(cluster, prompts[7])
        return loads, last.timings

    loads, timings = run_cluster(config, scenario)
    assert [load.num_threads for load in loads] == [1, 1]
    assert timings["transport"] == "shm"
    assert timings["kv_bytes"] > 0
    assert timings["prefill_worker"] == "prefill-0" and timings["decode_worker"] == "decode-0"
    for phase in ("prefill_queue_s", "prefill_s", "kv_transfer_s", "ttft_s", "decode_s", "e2e_s"):
        assert timings[phase] is not None and timings[phase] >= 0, phase


@ray.remote(num_cpus=0)
def _cores_at_boot() -> tuple[int, ...]:
    """Where a fresh Ray worker process runs as its first task starts."""
    return process_cores()


def _thread_cores(pid: int) -> set[tuple[int, ...]]:
    """The distinct core sets of process `pid`'s threads (a thread that ends meanwhile
    is skipped; a process that has ended has none)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return set()
    found = set()
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            found.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
    return found


@pytest.mark.parametrize("policy", ["least_loaded"])
def test_a_burst_spreads_over_both_decode_workers(tiny_llama_dir, reference, policy):
    """Requests routed before any health report still spread: a decode worker counts a
    request from the moment it is picked (with the prefill), not when decode starts."""
    prompts, expected = reference
    config = tiny_cluster_config(
        tiny_llama_dir, transport={"name": "shm"}, decode={"workers": 2}, router_policy=policy
    )

    async def scenario(cluster):
        from tests.cluster_helpers import collect

        results = await asyncio.gather(*(collect(cluster, p) for p in prompts[:8]))
        await assert_cluster_leak_free(cluster)
        idle = [w.in_flight for w in cluster.controller.workers.values()]
        return results, idle

    results, idle = run_cluster(config, scenario)
    used = [timings.timings["decode_worker"] for _, timings in results]
    assert sorted(used) == ["decode-0"] * 4 + ["decode-1"] * 4
    assert [tokens for tokens, _ in results] == expected[:8]
    assert idle == [0] * len(idle)  # every claim released


@pytest.mark.parametrize("skew_s", [-2.0])
def test_timing_receipt_adds_up_when_a_worker_clock_is_off(
    tiny_llama_dir, reference, skew_s, monkeypatch
):
    """Workers report durations on their own (here skewed) clock; the driver places them
    inside the spans it measured itself, so the parts still tile its TTFT."""
    prompts, _ = reference
    monkeypatch.setenv("PDSERVE_CLOCK_SKEW_S", str(skew_s))  # inherited by the Ray workers
    config = tiny_cluster_config(
        tiny_llama_dir, transport={"name": "shm"}, first_token_from="decode"
    )

    async def scenario(cluster):
        from tests.cluster_helpers import collect

        return [(await collect(cluster, p))[1].timings for p in prompts[:4]]

    for timings in run_cluster(config, scenario):
        parts = timings["ttft_parts"]
        assert abs(sum(parts.values()) - timings["ttft_s"]) < 0.005, parts
        assert min(parts.values()) > -0.001, parts  # no phase shifted out of its span
        assert parts["prefill_s"] > 0 and parts["kv_transfer_s"] > 0
        assert parts["prefill_s"] < timings["ttft_s"]


@pytest.mark.skipif(
    not pinning_supported() or len(process_cores()) < 2, reason="needs Linux and two cores"
)
def test_each_worker_runs_on_its_own_cores_and_the_driver_gets_its_back(
    tiny_llama_dir, reference, no_ray_head
):
    """1 + 1 workers of one thread: the prefill worker alone on the first core, the decode
    worker, this driver and Ray's processes (moved there once the workers are up) on the
    second; a process Ray starts later for a worker boots on that worker's cores; the
    driver's cores come back at shutdown, and outputs are unchanged."""
    prompts, expected = reference
    cores = process_cores()
    config = tiny_cluster_config(tiny_llama_dir, transport={"name": "shm"}, pin_cores=True)

    async def scenario(cluster):
        workers = cluster.controller.workers
        loads = {wid: await w.handle.check_health.remote() for wid, w in workers.items()}
        tokens, _ = await collect(cluster, prompts[7])
        during = {wid: _thread_cores(load.pid) for wid, load in loads.items()}
        reported = {wid: load.cpu_cores for wid, load in loads.items()}
        workers = {load.pid for load in loads.values()}
        ray_own = [pid for pid in local_head_pids() if pid not in workers]
        ray_cores = set().union(*(_thread_cores(pid) for pid in ray_own))
        booted = await _cores_at_boot.options(
            runtime_env={"env_vars": {BOOT_CORES_ENV: str(cores[0])}}
        ).remote()
        return during, reported, _thread_cores(os.getpid()), ray_cores, len(ray_own), booted, tokens

    during, reported, driver, ray_cores, ray_processes, booted, tokens = run_cluster(
        config, scenario
    )
    assert booted == cores[:1]  # Ray's setup hook: before the task's imports
    assert during == {"prefill-0": {cores[:1]}, "decode-0": {cores[1:2]}}
    assert reported == {"prefill-0": cores[:1], "decode-0": cores[1:2]}
    assert driver == {cores[1:2]}
    assert ray_processes >= 2 and ray_cores == {cores[1:2]}  # GCS and raylet at least
    assert process_cores() == cores
    assert tokens == expected[7]


def _ray_daemons() -> list[str]:
    """The GCS and raylet processes this test process started and that still run."""
    import psutil

    names = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):  # another test's process, ending
            if child.status() != psutil.STATUS_ZOMBIE and child.name() in ("gcs_server", "raylet"):
                names.append(child.name())
    return sorted(names)


def _start_with_first_head_stalled(stall_first_start) -> list[dict]:
    """Starts the controller's local head through `ray.init` with the first start made to
    stall by `stall_first_start` (a context manager), and checks that the second start
    serves and that the stalled head's processes were killed, not left running."""
    from cluster.config import ClusterConfig
    from cluster.control.controller import Controller

    real_init, starts = ray.init, []

    def first_start_stalls(**kwargs):
        starts.append(kwargs)
        if len(starts) > 1:
            return real_init(**kwargs)
        with stall_first_start():
            return real_init(**kwargs)

    controller = Controller(ClusterConfig())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray, "init", first_start_stalls)
        try:
            controller.init_ray()
            assert ray.is_initialized()
            assert ray.cluster_resources()["decode_pool"] > 0
            assert _ray_daemons() == ["gcs_server", "raylet"]
        finally:
            asyncio.run(controller.shutdown())
    assert not ray.is_initialized()
    return starts


def test_a_head_whose_gcs_never_publishes_its_port_is_started_again(monkeypatch, no_ray_head):
    """A local head's GCS that publishes no port (seen once in a few hundred starts on the
    2-core machine) is killed and a new head started. Here the first head's wait is cut
    to nothing, so Ray's own start fails as it did there, halfway, with its GCS up."""
    from cluster.control.local_head import GCS_PORT_WAIT_ENV

    @contextlib.contextmanager
    def no_wait_for_the_port():
        monkeypatch.setenv(GCS_PORT_WAIT_ENV, "0")
        try:
            yield
        finally:
            monkeypatch.setenv(GCS_PORT_WAIT_ENV, "60")

    assert len(_start_with_first_head_stalled(no_wait_for_the_port)) == 2


def test_a_head_whose_raylet_never_registers_is_started_again(no_ray_head):
    """A raylet that never registers with its GCS (seen in CI: no log written, still
    unregistered two minutes on) makes Ray's start raise after its fixed 30 s, with the
    GCS and raylet running; those are killed and a new head started. Here the lookup of
    the node in the GCS raises Ray's own error at once, from inside the same wait."""
    import ray._private.services as ray_services

    def node_never_registers(*args, **kwargs):
        raise Exception(
            "The current node timed out during startup. This could happen because some "
            "of the raylet failed to startup or the GCS has become overloaded."
        )

    @contextlib.contextmanager
    def raylet_never_registers():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ray_services, "get_node", node_never_registers)
            yield

    assert len(_start_with_first_head_stalled(raylet_never_registers)) == 2
