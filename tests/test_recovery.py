"""Failure drills on real processes: kill workers or break transfers under load, lose nothing.

Each scenario runs at least 8 concurrent streaming requests, strikes while they are in
flight, and then asserts: no request lost, each stream's tokens equal the greedy
reference (no token duplicated or missing), no KV block or lease leaked on any live
worker, and the next requests succeed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cluster.flow.cluster import PDCluster
from cluster.flow.disaggregation import Disaggregation, PathChoice
from engine.sampling_params import SamplingParams
from tests.cluster_helpers import assert_cluster_leak_free, reference_outputs, tiny_cluster_config
from tests.factories import make_engine
from tests.inprocess_cluster import InProcessCluster

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_head")]

LONG = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 290 + 5 for j in range(5 + 4 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return reference_outputs(tiny_llama_dir, PROMPTS, LONG.max_tokens)


@pytest.fixture(scope="module")
def expected_text(tiny_llama_dir):
    """What an uninterrupted stream shows (the same incremental detokenization)."""
    return {
        tuple(p): s.output_text
        for p, s in zip(PROMPTS, make_engine(tiny_llama_dir).generate(PROMPTS, LONG), strict=True)
    }


async def stream_tokens(cluster, prompt, started: asyncio.Event, min_chunks: int = 3):
    tokens, text, chunks, last = [], "", 0, None
    async for chunk in cluster.generate(prompt, LONG):
        tokens += chunk.token_ids
        text += chunk.text
        chunks += 1
        last = chunk
        if chunks == min_chunks:
            started.set()
    return tokens, last.timings | {"text": text}


async def pid_of(cluster, worker_id: str) -> int:
    return (await cluster.controller.workers[worker_id].handle.check_health.remote()).pid


async def run_with_strike(cluster, strike) -> list[tuple[list[int], dict]]:
    """Start all requests, wait until every stream is flowing, strike, collect."""
    events = [asyncio.Event() for _ in PROMPTS]
    tasks = [
        asyncio.create_task(stream_tokens(cluster, p, e))
        for p, e in zip(PROMPTS, events, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[:4])), timeout=60)
    await strike()
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)


def scenario(config, strike, expected, expected_text):
    async def main():
        cluster = await PDCluster(config).start()
        try:
            results = await run_with_strike(cluster, lambda: strike(cluster))
            await assert_cluster_leak_free(cluster, wait_s=15)
            after = [t async for t in _tokens(cluster, PROMPTS[0])]
            return results, after
        finally:
            await cluster.shutdown()

    results, after = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    # Streamed text equals an uninterrupted run's: nothing repeated or dropped on recovery.
    assert [timings["text"] for _, timings in results] == [expected_text[tuple(p)] for p in PROMPTS]
    assert after == expected[0]
    return [timings for _, timings in results]


async def _tokens(cluster, prompt):
    async for chunk in cluster.generate(prompt, LONG):
        for token in chunk.token_ids:
            yield token


def kill(cluster, worker_id):
    async def strike():
        os.kill(await pid_of(cluster, worker_id), signal.SIGKILL)

    return strike()


# --- kills that hit: every worker holds a request when one is killed ---------------------

STEADY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
WAVE_1 = [[(5 * i + 7 * j) % 290 + 5 for j in range(20 + 3 * i)] for i in range(8)]
"""Short prompts that keep both decode workers streaming."""
WAVE_2 = [[(11 * i + 3 * j) % 290 + 5 for j in range(180 + 4 * i)] for i in range(8)]
"""Long prompts that keep both prefill workers busy (16-token chunks, slowed steps)."""


@pytest.fixture(scope="module")
def steady_expected(tiny_llama_dir):
    return reference_outputs(tiny_llama_dir, WAVE_1 + WAVE_2, STEADY.max_tokens)


async def holdings(cluster) -> tuple[dict[str, int], dict[str, int]]:
    """(worker -> requests it holds something for: a sequence or an export's lease,
    worker -> sequences alone)."""
    states = await cluster.controller.debug_states()
    sequences = {w: len(s.get("requests", {})) for w, s in states.items()}
    return {w: n + len(states[w].get("leases", [])) for w, n in sequences.items()}, sequences


async def strike_when_all_hold(cluster, victim: str, timeout_s: float = 60.0):
    """SIGKILL `victim` the moment every worker holds a request and the victim is working
    on a sequence (a lease alone may belong to an import that already landed); returns
    what it held and how many of those were sequences."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held, sequences = await holdings(cluster)
        everyone = len(held) == len(cluster.controller.workers) and min(held.values()) > 0
        if everyone and sequences[victim] > 0:
            os.kill(await pid_of(cluster, victim), signal.SIGKILL)
            return held[victim], sequences[victim]
        await asyncio.sleep(0.005)
    raise AssertionError(f"never saw every worker hold a request: {await holdings(cluster)}")


async def back_at_strength(cluster, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(w.alive for w in cluster.controller.workers.values()):
        assert time.monotonic() < deadline, "the killed worker never came back"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_kills_that_hit_lose_nothing(tiny_llama_dir, steady_expected, transport, monkeypatch):
    """A decode worker, then a prefill worker, each killed while every worker holds a
    request; each time every stream ends with exactly the reference tokens. Over shm the
    cluster keeps a prestarted process per role, and each restart is built in one."""
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", "0.03")  # inherited by the Ray workers
    # The second round resends the first round's prompts: with the prefix cache they
    # would prefill from cache in an instant and the prefill kill would find no work.
    config = tiny_cluster_config(
        tiny_llama_dir,
        transport={"name": transport},
        prefill={"workers": 2},
        decode={"workers": 2},
        prefix_caching=False,
        prestarted_workers=1 if transport == "shm" else 0,
    )

    async def collect(cluster, prompt):
        tokens, last = [], None
        async for chunk in cluster.generate(prompt, STEADY):
            tokens += chunk.token_ids
            last = chunk
        return tokens, last.timings

    async def under_load(cluster, victim: str):
        first = [asyncio.create_task(collect(cluster, p)) for p in WAVE_1]
        await asyncio.sleep(0.3)  # decode workers streaming
        second = [asyncio.create_task(collect(cluster, p)) for p in WAVE_2]
        held, working = await strike_when_all_hold(cluster, victim)
        results = await asyncio.wait_for(asyncio.gather(*first, *second), timeout=240)
        await back_at_strength(cluster)
        restarted = await cluster.controller.workers[victim].handle.check_health.remote()
        return held, working, results, restarted.startup

    async def main():
        cluster = await PDCluster(config).start()
        try:
            outcomes = {role: await under_load(cluster, f"{role}-0") for role in ROLES}
            await assert_cluster_leak_free(cluster, wait_s=15)
            return outcomes
        finally:
            await cluster.shutdown()

    for role, (held, working, results, startup) in asyncio.run(main()).items():
        assert held > 0, f"the {role} kill hit an idle worker"
        assert ("prestarted_s" in startup) == (transport == "shm"), startup
        assert [tokens for tokens, _ in results] == steady_expected, role
        # A prefill worker that held only a lease (its prompt already exported) fails the
        # transfer instead of the prefill call: that request recovers by recomputing.
        hit = {f"{role}_died", "transfer_failed"} if role == "prefill" else {"decode_died"}
        affected = [t for _, t in results if hit & set(t["recoveries"])]
        assert working > 0, f"the {role} kill hit no sequence in flight"
        assert affected, f"no request went through the {role} kill"
        for timings in affected:  # each recovery says how it got its KV back
            assert timings["e2e_s"] > 0
            assert timings["recovery_paths"][0] in ROLE_PATHS[role]


ROLES = ("decode", "prefill")
ROLE_PATHS = {
    "decode": ("repull", "reprefill", "recompute"),
    "prefill": ("prefill_retry", "recompute", "decode_side_prefill"),
}


def test_a_dead_decode_workers_streams_are_reexported_by_a_prefill_worker(
    tiny_llama_dir, expected, expected_text, monkeypatch
):
    """Every import landed and was acked, so the victim's streams have no export left to
    re-pull. A prefill worker, whose cache still holds the prompt, computes the KV of
    prompt and decided tokens and exports it to the survivor, which decodes on at once
    instead of stalling its own streams to recompute each one."""
    monkeypatch.setenv("PDSERVE_STEP_DELAY_S", "0.03")  # streams outlive the wait below
    # The tiny model computes a stream's KV in microseconds, so the policy would rightly
    # have the survivor do it; this test is about the path, so the policy says remote.
    monkeypatch.setattr(Disaggregation, "choose", lambda *args, **kw: PathChoice("remote", "test"))
    config = tiny_cluster_config(tiny_llama_dir, transport={"name": "shm"}, decode={"workers": 2})

    async def strike(cluster):
        await asyncio.sleep(1.5)  # health reports tell the router what the cache holds
        held = await cluster.controller.debug_states()
        assert held["decode-0"].get("requests"), "decode-0 held nothing to recover"
        await kill(cluster, "decode-0")

    timings = scenario(config, strike, expected, expected_text)
    affected = [t for t in timings if "decode_died" in t["recoveries"]]
    assert affected, "no stream went through the kill"
    for t in affected:  # prompt and decided tokens came over the link, none computed
        assert t["recovery_paths"] == ["reprefill"], t["recovery_paths"]
        assert not t["recomputed"] and t["cached_tokens"] == 0
        assert t["kv_blocks_moved"] > 0 and t["transport"] == "shm"


def test_kill_the_only_prefill_worker_decode_side_prefill_takes_over(tiny_llama_dir, expected):
    config = tiny_cluster_config(tiny_llama_dir, transport={"name": "shm"}, max_restarts=0)

    async def strike(cluster):
        await kill(cluster, "prefill-0")
        # Requests arriving now find no prefill worker: the decode worker prefills them.
        return [t async for t in _tokens(cluster, PROMPTS[1])]

    async def main():
        cluster = await PDCluster(config).start()
        try:
            results = await run_with_strike(cluster, lambda: strike(cluster))
            late, late_timings = await stream_tokens(cluster, PROMPTS[2], asyncio.Event())
            await assert_cluster_leak_free(cluster, wait_s=15)
            return results, late, late_timings
        finally:
            await cluster.shutdown()

    results, late, late_timings = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert late == expected[2]
    assert "decode_side_prefill" in late_timings["recoveries"]


@pytest.mark.parametrize(
    "fault,reason",
    [({"mode": "stall", "stall_s": 5.0}, "timeout"), ({"mode": "corrupt"}, "checksum")],
)
def test_broken_transfers_are_recomputed(tiny_llama_dir, expected, expected_text, fault, reason):
    """Transfers broken inside the transport, between the real workers in this process
    (tests/inprocess_cluster.py): the recovery is the request flow's, whatever process
    the workers live in."""
    config = tiny_cluster_config(
        tiny_llama_dir,
        transport={
            "name": "shm",
            "timeout_s": 1.0,
            "faults": {**fault, "after_fraction": 0.0},
        },
    )

    async def main():
        cluster = InProcessCluster(config)
        try:
            results = await run_with_strike(cluster.chunks_view(), _nothing)
            await cluster.assert_leak_free(wait_s=15)
            return results
        finally:
            await cluster.shutdown()

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert [timings["text"] for _, timings in results] == [expected_text[tuple(p)] for p in PROMPTS]
    timings = [timings for _, timings in results]
    assert all(t["recomputed"] and "transfer_failed" in t["recoveries"] for t in timings)
    assert {t["transfer_failure"] for t in timings} == {reason}


async def _nothing() -> None:
    return None
