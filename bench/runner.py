"""One measured run of `pdserve bench serve`: warm-up, then the workload under an arrival process.

A run's life: the warm-up requests (distinct prompts of the same workload) go first
and are kept apart; `/metrics` is scraped; the clock and the client's CPU counter
start; sessions are released by the arrival process (closed loop: a new one when a
slot frees; open loop: at their drawn send times, capped by the in-flight limit);
with `--duration` no session or turn starts after the deadline and those in flight
finish; when the last request ends the clock stops, `/metrics` is scraped again,
and the records are summarized. The client does no tokenizing on the hot path
(prompts and their token counts are made before the clock starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from bench import server_metrics
from bench.arrivals import ArrivalSpec, gap_stream
from bench.loadgen import RequestRecord, stream_request
from bench.prompt_text import PromptMaker
from bench.summary import Slo, summarize
from bench.workloads import Session, WorkloadSpec, build_sessions, iter_sessions, turn_body


@dataclass(frozen=True)
class RunSpec:
    """What one measured run does; built by the CLI, stored in the JSON header."""

    url: str
    model: str
    workload: WorkloadSpec
    arrival: ArrivalSpec
    num_prompts: int | None = 64
    """Sessions to run; None with `duration_s`."""
    duration_s: float | None = None
    warmup: int = 2
    ignore_eos: bool = True
    temperature: float | None = 0.0
    """None leaves sampling to the server's default."""
    api_key: str | None = None
    timeout_s: float = 600.0
    progress: bool = True
    slo: Slo | None = None
    seed: int = 0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.num_prompts is None) == (self.duration_s is None):
            raise ValueError("give exactly one of --num-prompts and --duration")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be positive")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")


@dataclass
class RunResult:
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    summary: dict
    started_at: float
    """perf_counter at the start of the measured interval (record times are relative to it)."""
    server_metrics: dict | None
    seed: int = 0


class Runner:
    """Drives one run over one HTTP session; `await Runner(spec, maker).run()`."""

    def __init__(self, spec: RunSpec, maker: PromptMaker):
        self.spec = spec
        self.maker = maker
        self.records: list[RequestRecord] = []
        self.deadline: float | None = None
        self.progress: tqdm | None = None

    async def run(self) -> RunResult:
        timeout = aiohttp.ClientTimeout(total=self.spec.timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # the arrival process limits, not aiohttp
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            self.http = http
            warmup = await self._warmup()
            sessions = self._sessions()
            before = await server_metrics.scrape(http, self.spec.url)
            result = await self._measure(sessions)
            after = await server_metrics.scrape(http, self.spec.url)
        result.warmup_records = warmup
        result.server_metrics = _metrics_entry(before, after)
        return result

    def _sessions(self):
        workload, seed = self.spec.workload, self.spec.seed
        if self.spec.num_prompts is not None:
            return build_sessions(workload, self.maker, self.spec.num_prompts, seed)
        return iter_sessions(workload, self.maker, seed)

    async def _warmup(self) -> list[RequestRecord]:
        """Distinct prompts (another seed), sent like the run's first wave; then dropped."""
        count = self.spec.warmup
        if not count:
            return []
        sessions = build_sessions(self.spec.workload, self.maker, count, self.spec.seed + 7919)
        width = min(count, self.spec.arrival.concurrency or count)
        gate = asyncio.Semaphore(width)
        records: list[RequestRecord] = []

        async def one(session: Session) -> None:
            async with gate:
                await self._send_turns(session, records, gate=None)

        await asyncio.gather(*(one(s) for s in sessions))
        return records

    async def _measure(self, sessions) -> RunResult:
        spec = self.spec
        total = None
        if spec.num_prompts is not None:
            total = sum(len(s.turns) for s in sessions)
        self.progress = tqdm(total=total, desc="requests", unit="req", disable=not spec.progress)
        cpu_start, start = time.process_time(), time.perf_counter()
        if spec.duration_s is not None:
            self.deadline = start + spec.duration_s
        try:
            await self._release(sessions, start)
        finally:
            self.progress.close()
        end = max((r.end for r in self.records), default=time.perf_counter())
        duration, cpu = end - start, time.process_time() - cpu_start
        self._count_unreported_output()
        summary = summarize(self.records, duration, spec.slo, client_cpu_s=cpu)
        return RunResult(self.records, [], summary, start, None, spec.seed)

    def _count_unreported_output(self) -> None:
        """After the clock stopped: output tokens of servers that send no usage, counted
        from the streamed text with the tokenizer (the actual length, EOS or not)."""
        for record in self.records:
            if record.ok and not record.completion_tokens and record.text:
                record.completion_tokens = len(
                    self.maker.hf.encode(record.text, add_special_tokens=False)
                )

    async def _release(self, sessions, start: float) -> None:
        arrival = self.spec.arrival
        in_flight = asyncio.Semaphore(arrival.concurrency) if arrival.concurrency else None
        slots = None if arrival.open_loop else in_flight
        gate = in_flight if arrival.open_loop else None
        tasks, due = [], start
        for session, gap in zip(sessions, gap_stream(arrival, self.spec.seed), strict=False):
            due += gap
            if self.deadline is not None and due >= self.deadline:
                break
            if slots is not None:
                await slots.acquire()
            else:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if self._past_deadline():
                if slots is not None:
                    slots.release()
                break
            scheduled = due if arrival.open_loop else None
            tasks.append(asyncio.create_task(self._session_task(session, slots, gate, scheduled)))
        await asyncio.gather(*tasks)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    async def _session_task(self, session, slots, gate, scheduled) -> None:
        try:
            await self._send_turns(session, self.records, gate, scheduled)
        finally:
            if slots is not None:
                slots.release()

    async def _send_turns(self, session: Session, records, gate, scheduled=None) -> None:
        """The session's turns one after another; a conversation stops at its first failure."""
        for number, turn in enumerate(session.turns):
            if number and self._past_deadline():
                return
            record = self._new_record(session, number, len(records), scheduled)
            records.append(record)
            body = self._body(session, number)
            async with gate if gate is not None else contextlib.nullcontext():
                await stream_request(self.http, self.spec.url, body, record, self.spec.api_key)
            if self.progress is not None and records is self.records:
                self.progress.update(1)
            if session.conversation:
                if not record.ok:
                    return
                session.history.extend(
                    [
                        {"role": "user", "content": turn.content},
                        {"role": "assistant", "content": record.text},
                    ]
                )
            scheduled = None  # later turns go when the previous one ends

    def _new_record(self, session: Session, number: int, index: int, scheduled) -> RequestRecord:
        turn = session.turns[number]
        return RequestRecord(
            index=index,
            endpoint=self.spec.workload.endpoint,
            session=session.index,
            turn=number,
            group=session.group,
            prompt_tokens=turn.prompt_tokens,
            output_len=turn.output_len,
            scheduled=scheduled,
        )

    def _body(self, session: Session, number: int) -> dict:
        spec, turn = self.spec, session.turns[number]
        body = {
            "model": spec.model,
            **turn_body(session, number, self.maker, spec.workload.endpoint),
            "max_tokens": turn.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
            **spec.extra_body,
        }
        if spec.ignore_eos:
            body["ignore_eos"] = True
        if spec.temperature is not None:
            body["temperature"] = spec.temperature
        return body


def _metrics_entry(before: dict | None, after: dict | None) -> dict | None:
    change = server_metrics.delta(before, after)
    if change is None:
        return None
    return {"delta": change, "digest": server_metrics.digest(change)}


async def run_once(spec: RunSpec, maker: PromptMaker) -> RunResult:
    return await Runner(spec, maker).run()
