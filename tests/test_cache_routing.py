"""Cache-aware routing and conditional disaggregation, as decisions: fake workers with
health reports, no Ray."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from cluster.control.worker_info import WorkerInfo
from cluster.flow.disaggregation import (
    Disaggregation,
    PathInputs,
    crossover_prompt_len,
    predict,
)
from cluster.flow.router import BALANCE_ABS, BALANCE_REL, LocalPrefill, Router
from engine.llm_engine import StepRecord
from engine.prefix_cache import CacheReport, hash_seed, prompt_hashes
from engine.step_costs import fit_step_costs
from worker.messages import HealthReport

BLOCK = 16
SEED = hash_seed("demo", "float32", BLOCK)
DEMO_BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2-135M, float32: 737,280 B


def tokens(n: int, salt: int) -> list[int]:
    return [(13 * i + 101 * salt) % 40000 + 7 for i in range(n)]


def report(worker_id, role, held=(), running=0, costs=None) -> HealthReport:
    cache = CacheReport(SEED, BLOCK, list(held), 0, 0, 0, len(held))
    return HealthReport(
        worker_id, role, 0, 1000, 1000, running, 0, 1, 1, prefix_cache=cache, step_costs=costs
    )


def workers(role: str, count: int, holding: dict[int, list[int]] | None = None) -> dict:
    pool = {}
    for i in range(count):
        info = WorkerInfo(f"{role}-{i}", role, handle=None)
        info.load = report(info.worker_id, role, (holding or {}).get(i, ()))
        pool[info.worker_id] = info
    return pool


PREFIX = tokens(1024, salt=1)


def with_question(salt: int) -> list[int]:
    return PREFIX + tokens(32, salt=salt + 100)


# --- cache_aware ---------------------------------------------------------------------


def test_a_repeat_prefix_goes_to_the_worker_that_holds_it():
    held = prompt_hashes(SEED, PREFIX, BLOCK)
    pool = workers("decode", 3, {2: held})
    router = Router("cache_aware", pool)

    claim = router.pick("decode", "r1", tokens=with_question(1))

    assert claim.worker.worker_id == "decode-2"
    assert claim.decision.reason == "cache"
    assert claim.decision.cached_blocks == 64 and claim.decision.prompt_blocks == 66
    claim.release()


def test_what_was_just_routed_counts_before_any_report_says_so():
    router = Router("cache_aware", workers("prefill", 3))
    first = router.pick("prefill", "r1", tokens=with_question(1))
    first.release()  # its prefill is done; no health report came since

    second = router.pick("prefill", "r2", tokens=with_question(2))

    assert second.worker is first.worker and second.decision.reason == "cache"
    # the claim brings only the uncached tokens as queued prefill work
    assert second.worker.claimed_tokens == len(with_question(2)) - 64 * BLOCK


def test_load_is_spread_when_every_worker_holds_the_prefix():
    held = prompt_hashes(SEED, PREFIX, BLOCK)
    pool = workers("decode", 3, {0: held, 1: held, 2: held})
    router = Router("cache_aware", pool)

    claims = [router.pick("decode", f"r{i}", tokens=with_question(i)) for i in range(9)]

    assert [w.in_flight for w in pool.values()] == [3, 3, 3]
    assert {c.decision.reason for c in claims} == {"load"}


def test_a_skewed_workload_stays_within_the_balance_bound():
    # 90% of the requests share one prefix, first cached on decode-0; requests end at
    # random, so the in-flight counts move.
    held = prompt_hashes(SEED, PREFIX, BLOCK)
    pool = workers("decode", 4, {0: held})
    router = Router("cache_aware", pool)
    rng = random.Random(0)
    live, reasons = [], []
    for i in range(400):
        prompt = with_question(i) if rng.random() < 0.9 else tokens(300, salt=1000 + i)
        claim = router.pick("decode", f"r{i}", tokens=prompt)
        reasons.append(claim.decision.reason)
        live.append(claim)
        loads = [w.in_flight for w in pool.values()]
        least = min(loads)
        assert max(loads) <= max(least + BALANCE_ABS, least * BALANCE_REL) + 1, loads
        while len(live) > 24 or (live and rng.random() < 0.3):
            live.pop(rng.randrange(len(live))).release()
    assert "balance" in reasons and "cache" in reasons
    for claim in live:
        claim.release()
    assert [w.in_flight for w in pool.values()] == [0, 0, 0, 0]
    assert [w.claimed_tokens for w in pool.values()] == [0, 0, 0, 0]


def test_the_next_turn_of_a_conversation_finds_its_decode_worker():
    pool = workers("decode", 3)
    router = Router("cache_aware", pool)
    turn1 = tokens(200, salt=7)
    claim = router.pick("decode", "t1", tokens=turn1)
    claim.release()
    outputs = tokens(40, salt=8)
    router.remember_decoded(claim.worker.worker_id, turn1 + outputs[:-1])
    others = [w for w in pool.values() if w is not claim.worker]
    for other in others:  # busier than the holder, but not past the bound
        other.in_flight -= 1

    turn2 = router.pick("decode", "t2", tokens=turn1 + outputs + tokens(50, salt=9))

    assert turn2.worker is claim.worker
    assert turn2.decision.cached_blocks == (200 + 39) // BLOCK


# --- disaggregation: auto ---------------------------------------------------------------


def measured_costs(fixed_s=0.08, per_token_s=0.004):
    """A prefill worker's fit from its own step trace (demo model, one CPU core)."""
    trace = [StepRecord(0.0, fixed_s + per_token_s * n, 0, 1, n) for n in (16, 64, 256, 512, 512)]
    return fit_step_costs(trace)


def pair(decode_running=4, costs=None):
    costs = costs or measured_costs()
    prefill = WorkerInfo(
        "prefill-0", "prefill", None, load=report("prefill-0", "prefill", costs=costs)
    )
    decode = WorkerInfo(
        "decode-0", "decode", None, load=report("decode-0", "decode", running=decode_running)
    )
    return prefill, decode


def decider(cap: float | None = None) -> Disaggregation:
    router = Router("cache_aware", {})
    d = Disaggregation("auto", router.views, 512, BLOCK, configured_bandwidth=cap)
    d.costs.block_bytes = DEMO_BLOCK_BYTES
    return d


def test_the_fit_recovers_the_step_costs():
    costs = measured_costs()
    assert costs.prefill_fixed_s == pytest.approx(0.08)
    assert costs.prefill_token_s == pytest.approx(0.004)


def test_auto_prefills_a_short_prompt_locally_and_a_long_one_remotely():
    prefill, decode = pair()
    d = decider()

    short = d.choose(tokens(16, salt=1), prefill, decode)
    long = d.choose(tokens(1024, salt=2), prefill, decode)

    assert (short.path, short.reason) == ("local", "cheaper")
    assert (long.path, long.reason) == ("remote", "cheaper")
    assert long.moved_blocks == 64 and long.remote_s < long.local_s


@pytest.mark.parametrize("measured", [False, True])
def test_remote_turns_local_as_the_link_cap_drops(measured):
    prefill, decode = pair()
    paths = {}
    for mbps in (None, 1000, 100, 30, 10, 3):
        cap = None if mbps is None else mbps * 1e6
        d = decider(None if measured else cap)
        if measured and cap is not None:  # what a capped transfer of 16 MB measured
            d.costs.observe(_transferred(16 << 20, (16 << 20) / cap))
        paths[mbps] = d.choose(tokens(1024, salt=2), prefill, decode).path
    assert paths == {
        None: "remote",
        1000: "remote",
        100: "remote",
        30: "remote",
        10: "local",
        3: "local",
    }


def test_an_idle_decode_worker_or_a_queued_prefill_worker_keeps_prompts_local():
    prefill, idle = pair(decode_running=0)
    assert decider().choose(tokens(1024, salt=2), prefill, idle).path == "local"
    prefill, busy = pair()
    prefill.claimed_tokens = 4000  # four long prompts ahead of this one
    assert decider().choose(tokens(1024, salt=2), prefill, busy).path == "local"


def test_prompts_already_sent_to_the_decode_worker_count_against_local():
    """A burst: each prompt auto sends to the decode worker queues behind the ones sent
    before it, so after a few the prefill worker is the cheaper path again."""
    prefill, decode = pair(decode_running=0)
    d = decider()
    paths, holds = [], []
    for salt in range(8):
        prompt = tokens(256, salt=10 + salt)
        choice = d.choose(prompt, prefill, decode)
        paths.append(choice.path)
        if choice.path == "local":
            holds.append(LocalPrefill(decode, len(prompt)))
        else:
            prefill.claimed_tokens += len(prompt)
    assert paths[0] == "local" and "remote" in paths
    assert decode.local_prefill_tokens == 256 * paths.count("local")
    for hold in holds:
        hold.release()
        hold.release()  # idempotent
    assert decode.local_prefill_tokens == 0


def test_what_the_decode_worker_holds_makes_the_local_path_cheap():
    prefill, decode = pair()
    history = tokens(1024, salt=3)
    d = decider()
    d.views.seed, d.views.block_size = SEED, BLOCK
    d.views.note("decode-0", prompt_hashes(SEED, history, BLOCK))
    choice = d.choose(history + tokens(40, salt=4), prefill, decode)
    assert choice.path == "local"


def test_always_never_and_unmeasured():
    prefill, decode = pair()
    prompt = tokens(1024, salt=2)
    for mode, expected in (("always", ("remote", "always")), ("never", ("local", "never"))):
        d = Disaggregation(mode, Router("cache_aware", {}).views, 512, BLOCK)
        choice = d.choose(prompt, prefill, decode)
        assert (choice.path, choice.reason) == expected
    fresh = WorkerInfo("prefill-1", "prefill", None, load=report("prefill-1", "prefill"))
    assert decider().choose(prompt, fresh, decode).reason == "unmeasured"


def test_the_crossover_moves_to_longer_prompts_as_bandwidth_drops():
    base = PathInputs(
        prompt_tokens=0,
        block_size=BLOCK,
        block_bytes=DEMO_BLOCK_BYTES,
        prefill_costs=measured_costs(),
        decode_costs=None,
        bandwidth=2e9,
        prefill_chunk=512,
        decode_running=4,
    )
    points = {
        bw: crossover_prompt_len(PathInputs(**{**base.__dict__, "bandwidth": bw}), 4096)
        for bw in (2e9, 1e8, 2e7, 1e7)
    }
    assert points[2e9] <= points[1e8] <= points[2e7]
    assert points[1e7] is None  # per token, moving is slower than computing
    remote, local, _ = predict(PathInputs(**{**base.__dict__, "prompt_tokens": 16}))
    assert local < remote


def test_an_idle_decode_worker_is_priced_at_its_own_prompt_pieces():
    """A decode worker prefills in shorter pieces than a prefill worker (256 against 512
    tokens on CPUs under auto): an idle one pays the step's fixed cost per piece of its
    own, so a 1024-token prompt costs it two more fixed costs than at the prefill
    workers' chunk."""
    costs = measured_costs()
    inputs = PathInputs(
        prompt_tokens=1024,
        block_size=BLOCK,
        block_bytes=DEMO_BLOCK_BYTES,
        prefill_costs=costs,
        decode_costs=None,
        bandwidth=2e9,
        prefill_chunk=512,
    )
    _, at_prefill_chunk, _ = predict(inputs)
    _, at_own_pieces, _ = predict(dataclasses.replace(inputs, decode_chunk=256))
    assert at_own_pieces - at_prefill_chunk == pytest.approx(2 * costs.prefill_fixed_s)


def _transferred(num_bytes: int, seconds: float):
    imported = SimpleNamespace(ok=True, num_bytes=num_bytes, transfer_s=seconds)
    return SimpleNamespace(
        kv_block_bytes=DEMO_BLOCK_BYTES,
        imported=imported,
        prefill=None,
        prefill_worker="prefill-0",
        decode_worker="decode-0",
        ttft_parts=dict,
    )


def test_always_compares_both_paths_for_a_request_whose_prefill_worker_died():
    """Recovery: the survivor's queue just took the dead worker's prompts, so a prompt
    retried under `always` goes to its decode worker when that is sooner."""
    prefill, decode = pair()
    prefill.claimed_tokens = 4000
    d = Disaggregation("always", Router("cache_aware", {}).views, 512, BLOCK)
    prompt = tokens(1024, salt=2)
    assert d.choose(prompt, prefill, decode).path == "remote"
    choice = d.choose(prompt, prefill, decode, recovering=True)
    assert (choice.path, choice.reason) == ("local", "recovery")
    prefill.claimed_tokens = 0
    assert d.choose(prompt, prefill, decode, recovering=True).path == "remote"
