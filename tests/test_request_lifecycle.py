"""Every request owned, aborted and released exactly once: the engine's states and the
driver's request owner, without Ray (fake worker handles stand in for the actors)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from cluster.config import (
    COLOCATED_CPU_STEP_TOKENS,
    DECODE_SIDE_PREFILL_CPU_STEP_TOKENS,
    ClusterConfig,
    ConfigError,
    TransportConfig,
)
from cluster.control.worker_info import WorkerInfo
from cluster.flow.disaggregation import Disaggregation, PathChoice
from cluster.flow.request import ClusterRequest, RequestFailedError
from cluster.flow.request_flow import RequestFlow
from cluster.flow.router import Router
from cluster.timeline import RequestTimeline
from engine.errors import InvalidRequestError, RequestAbortedError
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from tests.factories import assert_no_leaks, make_engine
from tests.inprocess_cluster import LocalMethod
from worker.messages import ErrorEvent, ImportEvent, PrefillResult, TokenEvent

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt_of(n: int) -> list[int]:
    return [(7 * i) % 300 + 3 for i in range(n)]


def run_until_idle(engine, steps: int = 500) -> None:
    for _ in range(steps):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("engine did not go idle")


def prefilled(engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, GREEDY, stop_after_prefill=True)
    run_until_idle(engine)
    assert engine.sequences[request_id].status == SequenceStatus.PREFILLED
    return engine.sequences[request_id]


# --- the engine: an abort frees blocks in every state ---------------------------------


@pytest.mark.parametrize("state", ["waiting", "running", "prefilled", "ready"])
def test_abort_frees_the_blocks_of_a_request_in_any_state(tiny_llama_dir, state):
    engine = make_engine(tiny_llama_dir, prefill_chunk_size=8, max_batch_tokens=8)
    prompt = prompt_of(30)
    if state == "prefilled":
        prefilled(engine, "r", prompt)
    elif state == "ready":
        engine.begin_import("r", prompt, [5], GREEDY, len(prompt))
        engine.reserve_imports()
        engine.finish_import("r", ok=True, recompute=False)
    else:
        engine.add_request("r", prompt, GREEDY)
        if state == "running":
            engine.step()  # the first 8-token chunk: running, partly prefilled
    assert engine.sequences["r"].status.name.lower() == state
    assert engine.allocator.num_used > 0 or state == "waiting"

    assert engine.abort("r")
    assert_no_leaks(engine)
    assert engine.sequences == {}


def test_an_import_aborted_while_bytes_land_is_freed_when_the_transfer_stops(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(20)
    # 1. waiting for blocks: the abort frees nothing because nothing is held
    engine.begin_import("early", prompt, [5], GREEDY, len(prompt))
    assert engine.abort("early")
    assert engine.reserve_imports() == []
    assert_no_leaks(engine)
    # 2. blocks reserved, a transfer writing: the abort only marks it
    seq = engine.begin_import("late", prompt, [5], GREEDY, len(prompt))
    assert engine.reserve_imports() == [seq]
    held = engine.allocator.num_used
    assert held > 0 and engine.abort("late")
    assert engine.allocator.num_used == held
    # 3. the transfer stops writing: now the blocks come back, and nothing decodes
    assert not engine.finish_import("late", ok=True, recompute=False)
    assert_no_leaks(engine)


def test_a_failed_import_recomputes_into_its_blocks_or_is_dropped(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(20)
    expected = make_engine(tiny_llama_dir).generate([prompt], GREEDY)[0].output_token_ids
    seq = engine.begin_import("r", prompt, [], GREEDY, len(prompt))
    engine.reserve_imports()
    assert engine.finish_import("r", ok=False, recompute=True)
    run_until_idle(engine)
    assert seq.output_token_ids == expected
    engine.begin_import("x", prompt, [], GREEDY, len(prompt))
    engine.reserve_imports()
    assert not engine.finish_import("x", ok=False, recompute=False)
    assert_no_leaks(engine)


def test_an_abort_that_overtakes_its_request_refuses_it_later(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    assert not engine.abort("ghost")
    with pytest.raises(RequestAbortedError, match="ghost"):
        engine.add_request("ghost", prompt_of(5), GREEDY)
    with pytest.raises(RequestAbortedError):
        engine.begin_import("ghost", prompt_of(5), [1], GREEDY, 5)
    assert_no_leaks(engine)


def test_a_request_resumed_with_all_its_tokens_is_refused(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="max_tokens 2 already") as refused:
        engine.add_request("r1", [1, 2, 3], params, output_token_ids=[4, 5])
    assert refused.value.request_id == "r1"
    assert_no_leaks(engine)


def test_a_raising_export_frees_its_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prefilled(engine, "r", prompt_of(30))
    assert engine.allocator.num_used > 0

    def broken_export(_seq):
        raise ConnectionError("sender is gone")

    with pytest.raises(ConnectionError):
        engine.export_prefilled("r", broken_export)
    assert_no_leaks(engine)
    with pytest.raises(RequestAbortedError):  # and it cannot be exported twice
        engine.export_prefilled("r", broken_export)


def test_an_export_hands_the_blocks_to_its_lease(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prefilled(engine, "r", prompt_of(30))
    lent = engine.export_prefilled("r", lambda seq: list(seq.block_ids))
    assert engine.sequences == {} and engine.allocator.num_used == len(lent)
    engine.release_blocks(lent)  # what the lease's ack / abort / expiry triggers
    assert_no_leaks(engine)


def test_max_num_seqs_bounds_the_batch_with_16_imports(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=4)
    reference = make_engine(tiny_llama_dir)
    prompts = [prompt_of(9 + i) for i in range(16)]
    expected = [s.output_token_ids for s in reference.generate(prompts, GREEDY)]
    firsts = [tokens[0] for tokens in expected]
    seqs = [
        engine.begin_import(f"r{i}", p, [firsts[i]], GREEDY, len(p)) for i, p in enumerate(prompts)
    ]
    for seq in engine.reserve_imports():
        # The KV the prefill side would send: computed here by a twin engine.
        source = make_engine(tiny_llama_dir)
        source_seq = prefilled(source, seq.request_id, seq.prompt_token_ids)
        engine.kv_pool.write_blocks(seq.block_ids, source.kv_pool.read_blocks(source_seq.block_ids))
        engine.finish_import(seq.request_id, ok=True, recompute=False)
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 4
    assert [s.output_token_ids for s in seqs] == expected
    assert_no_leaks(engine)


@pytest.mark.parametrize("covered", [0, 3, 5])
def test_an_import_may_bring_the_kv_of_decided_output_tokens(tiny_llama_dir, covered):
    """A migrated stream has 6 tokens decided; its import brings the KV of the prompt
    and of the first `covered` of them (at most all but the last, which the next step
    feeds). The engine computes what the import lacks and the stream goes on exactly."""
    prompt = prompt_of(13)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = make_engine(tiny_llama_dir).generate([prompt], params)[0].output_token_ids
    decided = expected[:6]
    engine = make_engine(tiny_llama_dir)
    seq = engine.begin_import("r", prompt, decided, params, len(prompt) + covered)
    [landing] = engine.reserve_imports()
    source = make_engine(tiny_llama_dir)  # computes the KV the prefill side sends
    source_seq = prefilled(source, "r", prompt + decided[:covered])
    engine.kv_pool.write_blocks(landing.block_ids, source.kv_pool.read_blocks(source_seq.block_ids))
    engine.finish_import("r", ok=True, recompute=False)
    run_until_idle(engine)
    assert seq.output_token_ids == expected
    assert_no_leaks(engine)


def test_an_import_of_more_than_the_decided_tokens_is_refused(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = prompt_of(13)
    with pytest.raises(InvalidRequestError, match="import of 16 tokens"):
        engine.begin_import("r", prompt, [5, 6, 7], GREEDY, len(prompt) + 3)
    with pytest.raises(InvalidRequestError, match="import of 12 tokens"):
        engine.begin_import("r", prompt, [5], GREEDY, len(prompt) - 1)
    assert_no_leaks(engine)


@pytest.mark.parametrize("headroom", ["kept", "ignored"])
def test_imports_that_fill_the_pool_exactly_still_decode(tiny_llama_dir, monkeypatch, headroom):
    """Two 16-token imports in a 4-block pool (8-token blocks) with nothing decoding: if
    both took their blocks, each would need a fifth for its next token and neither could
    ever start (the hang of a burst on a tiny decode pool). The import headroom makes the
    second wait for room; without it, the youngest READY sequence gives its blocks back
    and is recomputed: the outputs are the same either way."""
    from engine.scheduler import Scheduler

    if headroom == "ignored":
        monkeypatch.setattr(Scheduler, "_import_headroom", lambda self: 0)
    engine = make_engine(tiny_llama_dir, num_kv_blocks=4, max_model_len=32)
    reference = make_engine(tiny_llama_dir)
    prompts = [prompt_of(16), [t + 1 for t in prompt_of(16)]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [s.output_token_ids for s in reference.generate(prompts, params)]
    seqs = [
        engine.begin_import(f"r{i}", p, expected[i][:1], params, len(p))
        for i, p in enumerate(prompts)
    ]
    for _ in range(200):
        if not engine.sequences:
            break
        for seq in engine.reserve_imports():
            source = make_engine(tiny_llama_dir)  # computes the KV the prefill side sends
            source_seq = prefilled(source, seq.request_id, seq.prompt_token_ids)
            engine.kv_pool.write_blocks(
                seq.block_ids, source.kv_pool.read_blocks(source_seq.block_ids)
            )
            engine.finish_import(seq.request_id, ok=True, recompute=False)
        engine.step()
    assert [s.output_token_ids for s in seqs] == expected
    assert engine.scheduler.num_preemptions == (headroom == "ignored")
    assert_no_leaks(engine)


def test_a_request_that_fits_the_context_but_not_the_pool_is_refused_at_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=4, block_size=8, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="do not fit"):
        engine.add_request("r", prompt_of(20), SamplingParams(max_tokens=20))
    engine.add_request("ok", prompt_of(20), SamplingParams(max_tokens=12))  # 32 tokens fit
    run_until_idle(engine)
    assert_no_leaks(engine)


# --- configs that cannot work -----------------------------------------------------------


def test_pools_too_small_for_one_max_length_sequence_are_refused(tiny_llama_dir):
    config = ClusterConfig.from_dict(
        {"model": str(tiny_llama_dir), "block_size": 8, "decode": {"kv_blocks": 10}}
    )
    with pytest.raises(ConfigError, match=r"decode\.kv_blocks=10 cannot hold one 512-token"):
        config.check_pools(512)
    config.replace(max_model_len=80).check_pools(80)

    from cluster.flow.cluster import PDCluster

    with pytest.raises(ConfigError, match=r"decode\.kv_blocks"):
        PDCluster(config)  # before any Ray actor starts


def test_a_transport_that_cannot_join_two_processes_is_refused():
    with pytest.raises(ConfigError, match="'local' moves KV only within one process"):
        ClusterConfig(transport=TransportConfig(name="local"))
    ClusterConfig(transport=TransportConfig(name="local"), mode="colocated")
    with pytest.raises(ConfigError, match="transport: chunk_bytes"):
        ClusterConfig.from_dict({"transport": {"chunk_bytes": -1}})


def test_cpu_step_budgets_default_per_role_and_yield_to_the_setting():
    """A prefill worker's step is one prompt chunk; a colocated worker's is 1024 tokens
    (COLOCATED_CPU_STEP_TOKENS), within max_batch_tokens; prefill.batch_tokens sets both."""
    disaggregated, colocated = (
        ClusterConfig(),
        ClusterConfig(mode="colocated", transport=TransportConfig(name="local")),
    )
    assert disaggregated.engine_config("prefill").max_batch_tokens == 512
    assert disaggregated.engine_config("decode").max_batch_tokens == 2048
    assert colocated.engine_config("decode").max_batch_tokens == COLOCATED_CPU_STEP_TOKENS
    assert colocated.replace(max_batch_tokens=640).engine_config("decode").max_batch_tokens == 640
    assert (
        colocated.replace(prefill={"batch_tokens": 768}).engine_config("decode").max_batch_tokens
        == 768
    )
    assert (
        disaggregated.replace(prefill={"batch_tokens": 768})
        .engine_config("prefill")
        .max_batch_tokens
        == 768
    )


def test_a_cpu_decode_worker_that_prefills_on_its_own_keeps_its_steps_short():
    """Under `disaggregation: auto` a CPU decode worker's step, and so the prompt piece
    it may prefill in it, is capped at DECODE_SIDE_PREFILL_CPU_STEP_TOKENS; the prefill
    worker keeps its chunk; decode.batch_tokens sets the cap."""
    auto = ClusterConfig(disaggregation="auto")
    decode, prefill = auto.engine_config("decode"), auto.engine_config("prefill")
    assert (
        decode.max_batch_tokens == decode.prefill_chunk_size == DECODE_SIDE_PREFILL_CPU_STEP_TOKENS
    )
    assert prefill.max_batch_tokens == prefill.prefill_chunk_size == 512
    wide = auto.replace(decode={"batch_tokens": 1024}).engine_config("decode")
    assert (wide.max_batch_tokens, wide.prefill_chunk_size) == (1024, 512)
    narrow = ClusterConfig.from_dict({"decode": {"batch_tokens": 128}})
    assert narrow.engine_config("decode").max_batch_tokens == 128
    with pytest.raises(ConfigError, match=r"decode\.batch_tokens"):
        ClusterConfig.from_dict({"decode": {"batch_tokens": 0}})


def test_worker_threads_default_to_the_cores_shared_by_the_serving_workers(monkeypatch):
    """Unset, every worker that serves at once gets an even share of this machine's
    cores (spares wait idle and do not count); a set value is kept as it is."""
    monkeypatch.setattr("cluster.config.os.cpu_count", lambda: 8)
    colocated = ClusterConfig(mode="colocated", transport=TransportConfig(name="local"))
    assert colocated.worker_threads == 8
    assert colocated.engine_config("decode").num_threads == 8
    assert colocated.replace(decode={"workers": 3}, standby_workers=1).worker_threads == 2
    assert ClusterConfig().worker_threads == 4  # 1 prefill + 1 decode worker
    wide = ClusterConfig.from_dict({"prefill": {"workers": 4}, "decode": {"workers": 5}})
    assert wide.worker_threads == 1
    assert ClusterConfig(threads_per_worker=3).engine_config("prefill").num_threads == 3
    with pytest.raises(ConfigError, match="threads_per_worker"):
        ClusterConfig(threads_per_worker=0)


# --- the driver's request owner, against fake workers -----------------------------------


class FakeWorker:
    """Stands in for a Ray actor handle: records calls, answers from a script."""

    def __init__(self, worker_id: str, role: str, script=None):
        self.info = WorkerInfo(worker_id, role, handle=self)
        self.calls: list[tuple[str, str]] = []
        self.script = script or {}
        self.gate = asyncio.Event()
        self.prefill = LocalMethod(self._prefill)
        self.decode = LocalMethod(self._decode)
        self.subscribe = LocalMethod(self._subscribe)
        self.events: asyncio.Queue = asyncio.Queue()
        self.feeds: list[asyncio.Future] = []
        """The running `_feed` tasks, held so that none is collected mid-request."""
        self.abort = LocalMethod(lambda rid: self._record("abort", rid))
        self.ack = LocalMethod(lambda rid: self._record("ack", rid))

    def _record(self, name: str, rid: str):
        self.calls.append((name, rid))

    async def _prefill(self, request):
        self._record("prefill", request.request_id)
        await self.gate.wait()
        return self.script["prefill"](request)

    async def _decode(self, request, subscriber):
        self._record("decode", request.request_id)
        self.feeds.append(asyncio.ensure_future(self._feed(request)))

    async def _feed(self, request):
        try:
            for item in self.script["decode"](request):
                await self.gate.wait()
                self.events.put_nowait([(request.request_id, item)])
                await asyncio.sleep(0)  # one event per request per "step", interleaved
            self.events.put_nowait([(request.request_id, None)])
        except Exception as exc:  # the worker "dies": its subscription stream breaks
            self.events.put_nowait(exc)

    async def _subscribe(self, subscriber):
        while True:
            batch = await self.events.get()
            if isinstance(batch, Exception):
                raise batch
            yield batch


def result_of(request, ticket=True) -> PrefillResult:
    return PrefillResult(
        request.request_id,
        "prefill-0",
        TokenEvent([7], "x", False, None, 1),
        len(request.prompt_token_ids),
        ticket=SimpleNamespace(num_tokens=3) if ticket else None,
        queue_s=0.0,
        prefill_s=0.0,
        export_s=0.0,
    )


def tokens_of(request):
    yield ImportEvent(True, "shm", 100, None, "", 0.0, 0.0, "decode-0")
    yield TokenEvent([8], "y", False, None, 2)
    yield TokenEvent([9], "z", True, "length", 3)


def cluster_of(prefill: FakeWorker, decode: FakeWorker):
    config = ClusterConfig(transport=TransportConfig(name="shm"), recovery_timeout_s=0.5)
    workers = {w.info.worker_id: w.info for w in (prefill, decode)}
    flow = RequestFlow(config, Router("round_robin", workers), lambda w, why, generation: None)
    return flow, workers


def open_request(request_id="r1") -> ClusterRequest:
    return ClusterRequest(request_id, [1, 2, 3], GREEDY, RequestTimeline(request_id, 0.0))


async def consume(flow, req, count=None):
    chunks = []
    stream = flow.run(req)
    try:
        async for chunk in stream:
            chunks.append(chunk)
            if count is not None and len(chunks) >= count:
                break
    finally:
        await stream.aclose()
    return chunks


def run_to_the_end(generate=tokens_of):
    """One request through ungated fake workers until its stream ends; the request is
    closed as finished. Returns (chunks, prefill worker, decode worker, request, workers)."""

    async def main():
        prefill = FakeWorker("prefill-0", "prefill", {"prefill": result_of})
        decode = FakeWorker("decode-0", "decode", {"decode": generate})
        prefill.gate.set(), decode.gate.set()
        flow, workers = cluster_of(prefill, decode)
        req = open_request()
        chunks = await consume(flow, req)
        req.close("finished")
        return chunks, prefill, decode, req, workers

    return asyncio.run(main())


def test_a_finished_request_acks_the_export_and_releases_every_claim():
    chunks, prefill, decode, _, workers = run_to_the_end()
    assert [c.token_ids for c in chunks] == [[7], [8], [9]]
    assert prefill.calls == [("prefill", "r1"), ("ack", "r1")]
    assert decode.calls == [("decode", "r1")]  # nothing left to abort
    assert [w.in_flight for w in workers.values()] == [0, 0]


def test_a_worker_that_dies_after_its_last_token_does_not_decode_the_request_again():
    """The worker's death can surface at the stream's end, after the finished token came:
    the request is complete and must not be migrated (that decoded one token too many)."""

    deaths = [RayActorError()]

    def tokens_then_death(request):
        yield from tokens_of(request)
        if deaths:
            raise deaths.pop()

    chunks, _, decode, req, workers = run_to_the_end(tokens_then_death)
    assert [c.token_ids for c in chunks] == [[7], [8], [9]]
    assert decode.calls == [("decode", "r1")]
    assert req.timeline.recoveries == []
    assert [w.in_flight for w in workers.values()] == [0, 0]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_close_aborts_what_each_worker_holds_and_releases_claims(phase):
    async def main():
        prefill = FakeWorker("prefill-0", "prefill", {"prefill": result_of})
        decode = FakeWorker("decode-0", "decode", {"decode": tokens_of})
        if phase == "decode":
            prefill.gate.set()
        flow, workers = cluster_of(prefill, decode)
        req = open_request()
        task = asyncio.ensure_future(consume(flow, req))
        await asyncio.sleep(0.05)  # the request is stuck in `phase`
        req.close("cancelled")  # the client went away
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        req.close("cancelled")  # idempotent
        return prefill.calls, decode.calls, workers

    prefill_calls, decode_calls, workers = asyncio.run(main())
    if phase == "prefill":  # queued or prefilling: the prefill worker is told, once
        assert prefill_calls == [("prefill", "r1"), ("abort", "r1")]
        assert decode_calls == []
    else:  # exported and importing: both sides are told, once
        assert prefill_calls == [("prefill", "r1"), ("abort", "r1")]
        assert decode_calls == [("decode", "r1"), ("abort", "r1")]
    assert [w.in_flight for w in workers.values()] == [0, 0]


def test_a_worker_side_error_comes_back_with_its_kind():
    def refuse(request):
        return ErrorEvent(request.request_id, "invalid_request", "does not fit the KV pool")

    async def main():
        prefill = FakeWorker("prefill-0", "prefill", {"prefill": refuse})
        decode = FakeWorker("decode-0", "decode", {"decode": tokens_of})
        prefill.gate.set()
        flow, workers = cluster_of(prefill, decode)
        req = open_request()
        with pytest.raises(RequestFailedError) as failure:
            await consume(flow, req)
        req.close("error")
        return failure.value, prefill.calls, workers

    error, prefill_calls, workers = asyncio.run(main())
    assert (error.kind, error.message) == ("invalid_request", "does not fit the KV pool")
    assert prefill_calls == [("prefill", "r1")]  # it holds nothing: no abort owed
    assert [w.in_flight for w in workers.values()] == [0, 0]


def test_the_streams_of_a_dead_decode_worker_see_each_others_recomputes(monkeypatch):
    """Each stream of a dead decode worker asks where its KV is rebuilt. One the survivor
    is to recompute counts as queued there until its first token, so the next stream's
    decision sees it (before, every stream piled its recompute onto the survivor), and
    a stream rebuilt on the prefill worker is re-exported from there."""
    seen: list[int] = []

    def choose(self, tokens, prefill, decode, recovering=False, salt=None):
        if not recovering:
            return PathChoice("remote", "always")
        seen.append(decode.local_prefill_tokens)
        return PathChoice("local" if decode.local_prefill_tokens == 0 else "remote", "test")

    monkeypatch.setattr(Disaggregation, "choose", choose)

    def first_token_then_death(request):
        yield ImportEvent(True, "shm", 100, None, "", 0.0, 0.0, "decode-0")
        yield TokenEvent([8], "y", False, None, 2)
        raise RayActorError()

    def rest(request):
        if request.ticket is not None:
            yield ImportEvent(True, "shm", 100, None, "", 0.0, 0.0, "decode-1")
        yield TokenEvent([9], "z", True, "length", 3)

    async def main():
        prefill = FakeWorker("prefill-0", "prefill", {"prefill": result_of})
        dying = FakeWorker("decode-0", "decode", {"decode": first_token_then_death})
        survivor = FakeWorker("decode-1", "decode", {"decode": rest})
        prefill.gate.set()
        workers = {w.info.worker_id: w.info for w in (prefill, dying, survivor)}
        config = ClusterConfig(transport=TransportConfig(name="shm"), recovery_timeout_s=0.5)
        router = Router("round_robin", workers)
        survivor.info.alive = False  # both requests start on decode-0
        flow = RequestFlow(config, router, lambda w, why, generation: setattr(w, "alive", False))
        requests = [open_request("r1"), open_request("r2")]
        streams = [asyncio.ensure_future(consume(flow, req)) for req in requests]
        while len(dying.calls) < 2:
            await asyncio.sleep(0.01)
        survivor.info.alive = True
        dying.gate.set()  # both streams are on decode-0 when it dies
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        survivor.gate.set()  # both decided before either gets a token on the survivor
        chunks = await asyncio.gather(*streams)
        for req in requests:
            req.close("finished")
        return chunks, requests, prefill, workers

    chunks, requests, prefill, workers = asyncio.run(main())
    assert [[c.token_ids for c in stream] for stream in chunks] == [[[7], [8], [9]]] * 2
    assert seen[0] == 0 and seen[1] > 0
    assert sorted(r.timeline.recovery_paths[0] for r in requests) == ["recompute", "reprefill"]
    assert [call for call, _ in prefill.calls].count("prefill") == 3  # two prompts, one rebuild
    assert [(w.in_flight, w.local_prefill_tokens) for w in workers.values()] == [(0, 0)] * 3


def test_an_event_channel_sends_a_steps_events_as_one_batch_and_aborts_on_close():
    """What one step wakes goes out as one batch, a request that ends without a final
    event is closed by None, and closing the channel (its driver left) ends the
    requests still running: their event generators run their `finally` (the abort)."""
    from decode_worker.event_channel import EventChannel

    async def main():
        channel = EventChannel()
        steps = {"a": asyncio.Queue(), "b": asyncio.Queue()}
        ended = []

        async def events(request_id, count):
            try:
                for i in range(count):
                    await steps[request_id].get()
                    yield f"{request_id}{i}"
            finally:
                ended.append(request_id)

        channel.forward("a", events("a", 2))
        channel.forward("b", events("b", 5))
        batches = channel.batches()
        for queue in steps.values():  # one engine step wakes both requests
            queue.put_nowait(None)
        first = await batches.__anext__()
        steps["a"].put_nowait(None)
        second = await batches.__anext__()
        assert ended == ["a"] and set(channel.forwarders) == {"b"}
        channel.close()
        rest = [batch async for batch in batches]
        await asyncio.sleep(0)
        return first, second, rest, list(ended)  # before asyncio.run cancels what is left

    first, second, rest, ended = asyncio.run(main())
    assert first == [("a", "a0"), ("b", "b0")]
    assert second == [("a", "a1"), ("a", None)]
    assert rest == [] and ended == ["a", "b"]


def test_a_channel_no_subscription_reads_is_closed_and_its_requests_abort():
    """A request that reaches a decode worker after its driver's stream ended makes a
    channel nobody reads: after the grace period the channel closes, and its request's
    events generator runs its `finally` (the abort that frees its KV blocks). A channel
    its driver's subscription reads stays."""
    from decode_worker.event_channel import EventChannels

    async def main():
        channels = EventChannels(grace_s=0.05)
        ended = []

        async def endless(request_id):
            try:
                while True:
                    await asyncio.sleep(1)
                    yield request_id
            finally:
                ended.append(request_id)

        orphan = channels.for_request("gone-driver")
        orphan.forward("orphan", endless("orphan"))
        live = channels.for_request("live-driver")
        live.forward("live", endless("live"))
        assert channels.for_subscriber("live-driver") is live
        reader = asyncio.get_running_loop().create_task(anext(live.batches()))
        await asyncio.sleep(0.2)
        state = (orphan.closed, live.closed, len(channels), list(ended))
        reader.cancel()
        return state

    orphan_closed, live_closed, remaining, ended = asyncio.run(main())
    assert orphan_closed and not live_closed
    assert remaining == 1 and ended == ["orphan"]


# --- the decode scheduler replays a recorded arrival pattern deterministically ----------


def replay_decode(landings: dict[int, list[tuple[str, float]]], steps: int = 12):
    """Feed imports into a decode scheduler at fixed steps (as prefill completions would
    land them) and record each step's batch: [(request id, tokens computed)]. The model
    is not needed: each sampled sequence gets a fixed token."""
    from engine.block_manager import BlockAllocator
    from engine.config import EngineConfig
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    config = EngineConfig(
        block_size=4, num_kv_blocks=64, max_num_seqs=3, max_batch_tokens=8, prefill_chunk_size=8
    )
    scheduler = Scheduler(config, BlockAllocator(64))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    batches = []
    for step in range(steps):
        for request_id, arrival in landings.get(step, []):
            seq = Sequence(request_id, [1] * 6, params, output_token_ids=[9], priority=arrival)
            seq.block_ids = scheduler.allocator.allocate(2, request_id)
            seq.num_computed_tokens = 6
            scheduler.add_ready(seq)
        chunks = scheduler.schedule()
        batches.append([(c.seq.request_id, c.num_new_tokens) for c in chunks])
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(9)
            if len(seq.output_token_ids) >= params.max_tokens:
                scheduler.remove(seq)
    scheduler.allocator.assert_all_free()
    return batches


def test_a_prompt_that_reached_the_cluster_earlier_waits_ahead_of_later_ones():
    """A stream rebuilt on a prefill worker after its decode worker died is an old
    request: it is prefilled before the prompts that arrived after it."""
    from engine.block_manager import BlockAllocator
    from engine.config import EngineConfig
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    scheduler = Scheduler(EngineConfig(block_size=4, num_kv_blocks=64), BlockAllocator(64))
    params = SamplingParams(max_tokens=4)
    for request_id, arrival in [("b", 2.0), ("c", 3.0), ("a", 1.0), ("d", 4.0), ("e", 4.0)]:
        scheduler.add(Sequence(request_id, [1] * 6, params, priority=arrival))
    assert [seq.request_id for seq in scheduler.waiting] == ["a", "b", "c", "d", "e"]


def test_the_decode_batches_follow_the_arrival_order_not_the_landing_order():
    # Four requests reached the cluster at t=1..4; their imports land at steps 0, 0, 2, 2
    # and at most 3 sequences decode at once.
    first = {0: [("a", 1.0), ("b", 2.0)], 2: [("c", 3.0), ("d", 4.0)]}
    swapped = {0: [("b", 2.0), ("a", 1.0)], 2: [("d", 4.0), ("c", 3.0)]}
    # Each has one token decided and decodes three more.
    expected = [
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1)],
        [("a", 1), ("b", 1), ("c", 1)],  # one seat left: c, which arrived first, takes it
        [("c", 1), ("d", 1)],
        [("c", 1), ("d", 1)],
        [("d", 1)],
        *[[]] * 6,
    ]
    assert replay_decode(first) == expected
    assert replay_decode(swapped) == expected


def test_a_step_in_progress_shows_the_requests_it_holds(tiny_llama_dir):
    """`EngineLoop.stepping`: what a prefill worker's debug state answers mid-step (the
    drill picks its victims by it, and a long prefill step must not hide its prompt)."""
    from engine.engine_loop import EngineLoop

    engine = make_engine(tiny_llama_dir)
    engine.step_delay_s = 0.3

    async def scenario():
        loop = EngineLoop(engine, track_stepping=True)
        try:
            assert loop.stepping is None
            await loop.call(
                lambda e: e.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=2))
            )
            seen = None
            for _ in range(100):
                seen = loop.stepping or seen
                if seen:
                    break
                await asyncio.sleep(0.01)
            assert seen == {"long": "waiting"} or seen == {"long": "running+blocks"}
            while engine.has_unfinished():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.4)
            assert loop.stepping is None
        finally:
            loop.stop()

    asyncio.run(scenario())
    assert_no_leaks(engine)
