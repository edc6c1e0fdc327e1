"""Streaming OpenAI requests, timed at the client: the one HTTP path of every benchmark.

A request's life here: its body is posted to `/v1/completions` or
`/v1/chat/completions` with `stream: true` and usage requested; every server-sent
event is read as it lands. The first chunk that carries text (completions `text`,
chat `delta.content`; a role-only chunk is not a token) stamps the time to first
token; each later text chunk stamps one inter-chunk gap; `[DONE]` ends it. How it
ended is its `outcome`: `ok` (saw `[DONE]` with no error), `error` (an HTTP status,
an error event in the stream, a stream cut short, a connection failure), `timeout`,
or `cancelled`. Nothing is decoded or tokenized while a stream is read, so the
client stays cheap on a machine it shares with the server.

Callers: `bench/runner.py` (`pdserve bench serve`, sweep, bandwidth) and `pdserve
drill` (through `run_load`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from bench.stats import percentile

__all__ = [
    "LoadSpec",
    "RequestRecord",
    "get_json",
    "percentile",
    "run_load",
    "served_model_id",
    "stream_completion",
    "stream_request",
]

_DATA = b"data: "


@dataclass
class RequestRecord:
    index: int
    prompt: str | list[int] | list[dict] | None = None
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
    outcome: str = "pending"
    """ok, error, timeout or cancelled, once the request is over."""
    endpoint: str = "completions"
    session: int = -1
    turn: int = 0
    group: int | None = None
    prompt_tokens: int | None = None
    """Counted by the client with the model's tokenizer before sending."""
    server_prompt_tokens: int | None = None
    """The server's usage.prompt_tokens."""
    output_len: int = 0
    """max_tokens asked for."""
    scheduled: float | None = None
    """When the arrival process wanted it sent (open loop); `start` is when it was."""
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1): the mean time per token after the first."""
        if self.first_token is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)

    @property
    def queued_s(self) -> float | None:
        return None if self.scheduled is None else max(0.0, self.start - self.scheduled)


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    record: RequestRecord,
    api_key: str | None = None,
) -> RequestRecord:
    """POST one streaming request (`body` already holds prompt/messages and sampling
    fields) and fill `record`; never raises except `CancelledError`."""
    path = "/v1/chat/completions" if record.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parts: list[str] = []
    record.start = time.perf_counter()
    try:
        async with session.post(f"{url}{path}", json=body, headers=headers) as response:
            record.status = response.status
            if response.status != 200:
                record.error = (await response.text())[:500]
                record.outcome = "error"
                return record
            await _read_events(response, record, parts)
    except asyncio.TimeoutError:
        record.error, record.outcome = "timed out", "timeout"
    except aiohttp.ClientError as exc:
        record.error, record.outcome = repr(exc)[:500], "error"
    except asyncio.CancelledError:
        record.error, record.outcome = "cancelled", "cancelled"
        raise
    finally:
        record.end = time.perf_counter()
        record.text = "".join(parts)
    return record


async def _read_events(response, record: RequestRecord, parts: list[str]) -> None:
    chat = record.endpoint == "chat"
    async for raw_line in response.content:
        if not raw_line.startswith(_DATA):
            continue
        payload = raw_line[len(_DATA) :].rstrip()
        if payload == b"[DONE]":
            record.ok = not record.error
            record.outcome = "ok" if record.ok else "error"
            return
        event = json.loads(payload)
        if "error" in event:
            error = event["error"]
            record.error = error.get("message", "error") if isinstance(error, dict) else str(error)
            continue
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                now = time.perf_counter()
                if record.first_token is None:
                    record.first_token = now
                record.chunk_times.append(now)
                parts.append(text)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        _read_usage(event, record)
    record.error = record.error or "stream ended before [DONE]"
    record.outcome = "error"


def _read_usage(event: dict, record: RequestRecord) -> None:
    usage = event.get("usage")
    if usage:
        record.completion_tokens = usage.get("completion_tokens") or record.completion_tokens
        record.server_prompt_tokens = usage.get("prompt_tokens")
    if "pdserve_timings" in event:
        record.server_timings = event["pdserve_timings"] or {}


# --- the simple closed loop `pdserve drill` uses ----------------------------------------


@dataclass(frozen=True)
class LoadSpec:
    url: str
    model: str
    prompts: list[str] | list[list[int]]
    """Text prompts or token-id prompts."""
    max_tokens: int = 64
    concurrency: int = 8
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    cold_cache: bool = False
    """Every request carries its own `cache_salt`: no prefix cache serves it."""


def completion_body(spec: LoadSpec, prompt) -> dict:
    body = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": spec.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.cold_cache:
        body["cache_salt"] = uuid.uuid4().hex
    return body


async def stream_completion(
    session: aiohttp.ClientSession, spec: LoadSpec, record: RequestRecord
) -> RequestRecord:
    body = completion_body(spec, record.prompt)
    return await stream_request(session, spec.url, body, record, spec.api_key)


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
