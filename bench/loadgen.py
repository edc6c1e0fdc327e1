"""An OpenAI-API load generator that measures like a careful engineer.

Every request is timed at the client: time to first token is the first chunk that
carries text (never a role-only chunk), inter-token latencies are the gaps between
content chunks, end-to-end runs to `[DONE]`. Failures are counted, not dropped.
Warm-up requests run first and are excluded from the results.

Used by `pdserve drill` and by the benchmark experiments.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestRecord:
    index: int
    prompt: str | list[int]
    ok: bool = False
    status: int = 0
    error: str = ""
    text: str = ""
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    server_timings: dict = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        if self.first_token is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class LoadSpec:
    url: str
    model: str
    prompts: list[str] | list[list[int]]
    """Text prompts or token-id prompts (exact lengths, as benchmarks want)."""
    max_tokens: int = 64
    concurrency: int = 8
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0


async def stream_completion(
    session: aiohttp.ClientSession, spec: LoadSpec, record: RequestRecord
) -> RequestRecord:
    body = {
        "model": spec.model,
        "prompt": record.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": spec.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    record.start = time.perf_counter()
    try:
        async with session.post(
            f"{spec.url}/v1/completions", json=body, headers=headers
        ) as response:
            record.status = response.status
            if response.status != 200:
                record.error = (await response.text())[:500]
                return record
            await _read_events(response, record)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        record.error = repr(exc)
    finally:
        record.end = time.perf_counter()
    return record


async def _read_events(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    async for raw_line in response.content:
        line = raw_line.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[len(b"data: ") :]
        if payload == b"[DONE]":
            record.ok = not record.error
            return
        event = json.loads(payload)
        if "error" in event:
            record.error = event["error"].get("message", "error")
            continue
        if event.get("usage"):
            record.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            if choice.get("text"):
                now = time.perf_counter()
                record.first_token = record.first_token or now
                record.chunk_times.append(now)
                record.text += choice["text"]
        if "pdserve_timings" in event:
            record.server_timings = event["pdserve_timings"]


async def run_load(spec: LoadSpec, warmup: int = 0) -> list[RequestRecord]:
    """Warm-up requests (excluded), then every prompt once at the given concurrency."""
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in range(warmup):
            await stream_completion(
                session, spec, RequestRecord(-1 - i, spec.prompts[i % len(spec.prompts)])
            )
        gate = asyncio.Semaphore(spec.concurrency)

        async def one(index: int, prompt: str) -> RequestRecord:
            async with gate:
                return await stream_completion(session, spec, RequestRecord(index, prompt))

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(spec.prompts)))


async def get_json(
    url: str, path: str, api_key: str | None = None, timeout_s: float = 30.0
) -> dict:
    """One GET against the server (model list, admin endpoints); raises on HTTP errors."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"{url}{path}", headers=headers) as r,
    ):
        r.raise_for_status()
        return await r.json()


async def served_model_id(url: str, api_key: str | None = None) -> str:
    return (await get_json(url, "/v1/models", api_key))["data"][0]["id"]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    done = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    itl = [gap for r in done for gap in r.itl_s]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done]
    tokens = sum(r.completion_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
    }
