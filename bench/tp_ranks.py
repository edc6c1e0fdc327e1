"""The processes of `pdserve bench tp` (bench/tp_bench.py): one per rank, spawned.

Rank r pins itself to its own cores, joins the group over a loopback TCP store and
loads its shard; rank 0 times prefill and decode with a clock on its collectives and
puts its figures (or its traceback) on the result queue, then stops the followers.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.engine_bench import _greedy, _prompts
from bench.tp_bench import PREFILL_PROMPTS
from engine.config import EngineConfig
from engine.cpu_affinity import pin_process
from engine.llm_engine import LLMEngine
from engine.model_spec import load_model_spec
from engine.parallel.follower import FollowerEngine
from engine.parallel.group import TPGroup

JOIN_TIMEOUT = timedelta(seconds=300)


@dataclass
class CollectiveClock:
    """Seconds rank 0 spent in collectives since `reset`: the forward's all-reduces and
    gather (`model_s`) and the step broadcasts to its followers (`step_s`)."""

    model_s: float = 0.0
    model_calls: int = 0
    step_s: float = 0.0

    def reset(self) -> None:
        self.model_s = self.step_s = 0.0
        self.model_calls = 0


@dataclass(frozen=True)
class TimedGroup(TPGroup):
    """Rank 0's `TPGroup`, adding each collective's wall time to `clock`."""

    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False)

    def all_reduce(self, tensor):
        start = time.perf_counter()
        out = super().all_reduce(tensor)
        self.clock.model_s += time.perf_counter() - start
        self.clock.model_calls += 1
        return out

    def all_gather(self, tensor, dim: int = -1):
        start = time.perf_counter()
        out = super().all_gather(tensor, dim)
        self.clock.model_s += time.perf_counter() - start
        self.clock.model_calls += 1
        return out

    def broadcast(self, tensor, timeout=None):
        start = time.perf_counter()
        out = super().broadcast(tensor, timeout)
        self.clock.step_s += time.perf_counter() - start
        return out


def rank_main(rank, size, threads, port, model, prompt_len, decode_steps, results) -> None:
    """A spawned rank's whole life. Rank 0 reports a dict of `TPRun` fields, or the
    traceback of what failed."""
    pin_process(range(rank * threads, rank * threads + threads))
    try:
        _serve_rank(rank, size, threads, port, model, prompt_len, decode_steps, results)
    except BaseException:
        if rank == 0:
            results.put(traceback.format_exc())
        raise


def _serve_rank(rank, size, threads, port, model, prompt_len, decode_steps, results) -> None:
    torch.set_num_threads(threads)
    config = _engine_config(model, threads, prompt_len, decode_steps)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=JOIN_TIMEOUT)
    joined = TPGroup.join(store, rank, size)
    hidden = load_model_spec(model).hidden_size
    bare_us = _all_reduce_us(lambda row: joined.group.allreduce([row]).wait(), joined, hidden)
    group_us = _all_reduce_us(joined.all_reduce, joined, hidden)
    if rank:
        FollowerEngine(config, joined).serve()
        return
    clock = CollectiveClock()
    engine = LLMEngine(
        config,
        TimedGroup(joined.rank, joined.size, joined.group, joined.device, joined.shm, clock=clock),
    )
    engine.model.pin_threads = True
    try:
        figures = _measure(engine, clock, prompt_len, decode_steps)
    finally:
        engine.stop_followers()
    results.put(
        dict(
            tp=size,
            threads_per_rank=threads,
            bare_all_reduce_us=bare_us,
            group_all_reduce_us=group_us,
            **figures,
        )
    )


TIMED_CALLS = 400
"""All-reduces timed by `_all_reduce_us`, after 40 untimed."""


def _all_reduce_us(all_reduce, group: TPGroup, hidden_size: int) -> float:
    """Microseconds of one decode all-reduce (a row of `hidden_size` floats) through
    `all_reduce`, timed on these ranks before their engines load. Every rank calls it
    (a collective); 0 at tp=1."""
    if not group.parallel:
        return 0.0
    row = torch.zeros(hidden_size)
    for _ in range(40):
        all_reduce(row)
    start = time.perf_counter()
    for _ in range(TIMED_CALLS):
        all_reduce(row)
    return (time.perf_counter() - start) / TIMED_CALLS * 1e6


def _engine_config(model: str, threads: int, prompt_len: int, decode_steps: int):
    blocks_per_prompt = -(-(prompt_len + decode_steps + 2) // 16) + 1
    return EngineConfig(
        model=model,
        dtype="float32",
        num_kv_blocks=PREFILL_PROMPTS * blocks_per_prompt + 8,
        max_num_seqs=PREFILL_PROMPTS,
        max_batch_tokens=PREFILL_PROMPTS * prompt_len,
        prefill_chunk_size=prompt_len,
        num_threads=threads,
    )


def _measure(engine, clock: CollectiveClock, prompt_len: int, decode_steps: int) -> dict:
    vocab = engine.spec.vocab_size
    engine.generate(_prompts(PREFILL_PROMPTS, prompt_len, vocab), _greedy(2))  # warm-up
    for i, prompt in enumerate(_prompts(PREFILL_PROMPTS, prompt_len, vocab)):
        engine.add_request(f"prefill-{i}", prompt, _greedy(1))
    clock.reset()
    start = time.perf_counter()
    engine.step()  # every prompt in this one step: max_batch_tokens holds them all
    prefill_s, prefill_collective_s = time.perf_counter() - start, clock.model_s
    while engine.has_unfinished():
        engine.step()
    engine.add_request("decode", _prompts(1, prompt_len, vocab)[0], _greedy(decode_steps + 1))
    engine.step()  # its prefill
    steps, model_s, model_calls, step_s = [], [], [], []
    while engine.has_unfinished():
        clock.reset()
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        model_s.append(clock.model_s)
        model_calls.append(clock.model_calls)
        step_s.append(clock.step_s)
    timed = slice(0, -1)  # the last step only finishes the request
    return dict(
        prefill_tok_s=PREFILL_PROMPTS * prompt_len / prefill_s,
        prefill_model_collective_ms=prefill_collective_s * 1e3,
        decode_step_ms=statistics.median(steps[timed]) * 1e3,
        decode_model_collective_ms=statistics.median(model_s[timed]) * 1e3,
        decode_collectives_per_step=int(statistics.median(model_calls[timed])),
        decode_step_broadcast_ms=statistics.median(step_s[timed]) * 1e3,
    )
