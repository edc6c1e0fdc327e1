"""OpenAI-compatible HTTP frontend over a `PDCluster` (FastAPI + uvicorn).

A request's path here: auth and size checks -> JSON parse and validation (4xx on
bad input, the server keeps serving) -> admission against a bounded number of
in-flight requests (429 + Retry-After past it) -> tokenize / chat template ->
`cluster.generate` streamed out as SSE chunks or collected into one response.
A client that disconnects cancels the stream, which aborts the request on its
workers and frees its KV blocks.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.sse import format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.cluster import PDCluster
from cluster.metrics import ClusterMetrics
from cluster.openai_protocol import ApiError, ParsedRequest, parse_body
from cluster.request_flow import GenerationChunk, TransferFailedError
from cluster.router import NoLiveWorkerError
from engine import envs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendSettings:
    api_key: str | None = None
    """When set, every /v1 call needs `Authorization: Bearer <api_key>`."""
    max_body_bytes: int = 4 << 20
    max_in_flight: int = 256
    """Requests admitted at once; past it, 429 with Retry-After."""
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_in_flight <= 0:
            raise ValueError("max_body_bytes and max_in_flight must be positive")


def build_app(
    cluster: PDCluster,
    settings: FrontendSettings | None = None,
    metrics: ClusterMetrics | None = None,
) -> FastAPI:
    settings = settings or FrontendSettings(api_key=envs.api_key())
    metrics = metrics or ClusterMetrics(cluster.controller)
    cluster.on_finish.append(lambda timeline, _chunk: metrics.observe_timeline(timeline))
    handler = OpenAIHandler(cluster, settings, metrics)
    app = FastAPI(title="pdserve", summary="Disaggregated prefill/decode LLM serving")
    app.state.handler = handler

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        return JSONResponse(
            ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code
        )

    @app.get("/health")
    async def health():
        return handler.health()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/admin/workers")
    async def admin_workers(request: Request):
        handler.authorize(request)
        return await handler.workers()

    @app.get("/v1/models")
    async def models(request: Request):
        handler.authorize(request)
        return handler.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handler.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handler.handle(request, "chat")

    return app


class OpenAIHandler:
    def __init__(self, cluster: PDCluster, settings: FrontendSettings, metrics: ClusterMetrics):
        self.cluster = cluster
        self.settings = settings
        self.metrics = metrics
        self.in_flight = 0
        self.model_names = {cluster.model_id, cluster.config.model}

    # --- small endpoints --------------------------------------------------------------

    def health(self) -> JSONResponse:
        live = {
            role: len(self.cluster.router.live(role)) for role in ("prefill", "decode", "colocated")
        }
        ready = (live["prefill"] and live["decode"]) or live["colocated"]
        return JSONResponse(
            {"status": "ok" if ready else "unavailable", "workers": live},
            status_code=200 if ready else 503,
        )

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.cluster.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                }
            ],
        }

    async def workers(self) -> dict:
        """Drills and operators: every worker's liveness, process, restarts and KV held."""
        states = await self.cluster.controller.debug_states()
        rows = []
        for worker in self.cluster.controller.workers.values():
            load = worker.load or {}
            rows.append(
                {
                    "worker_id": worker.worker_id,
                    "role": worker.role,
                    "alive": worker.alive,
                    "restarts": worker.restarts,
                    "pid": load.get("pid"),
                    "node_id": load.get("node_id"),
                    **states.get(worker.worker_id, {}),
                }
            )
        return {"workers": rows}

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}":
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    # --- generation -------------------------------------------------------------------

    async def handle(self, request: Request, kind: str):
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            self.authorize(request)
            parsed = parse_body(kind, await self._read_json(request))
            self._check_model(parsed.model)
            prompt_ids = self._prompt_ids(parsed)
            self._admit()
        except ApiError as exc:
            self.metrics.observe_outcome(
                "rejected" if exc.status in (429, 503) else "error", endpoint
            )
            raise
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        stream = self._generate(request_id, prompt_ids, parsed, endpoint)
        if parsed.stream:
            return StreamingResponse(
                self._sse(stream, request_id, parsed, len(prompt_ids)),
                media_type="text/event-stream",
            )
        return await self._collect(stream, request_id, parsed, len(prompt_ids))

    async def _read_json(self, request: Request):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            raise ApiError(413, f"request body over {self.settings.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > self.settings.max_body_bytes:
            raise ApiError(413, f"request body over {self.settings.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}") from None

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise ApiError(
                404,
                f"model '{model}' does not exist; this server serves '{self.cluster.model_id}'",
                param="model",
                kind="model_not_found",
            )

    def _prompt_ids(self, parsed: ParsedRequest) -> list[int]:
        tokenizer = self.cluster.tokenizer
        if parsed.kind == "chat":
            prompt_ids = tokenizer.apply_chat_template(parsed.prompt)
        elif isinstance(parsed.prompt, str):
            prompt_ids = tokenizer.encode(parsed.prompt)
        else:
            prompt_ids = list(parsed.prompt)
            if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
                raise ApiError(
                    400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt"
                )
        limit = self.cluster.max_model_len
        wanted = len(prompt_ids) + parsed.params.max_tokens
        if wanted > limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens; the request needs "
                f"{wanted} ({len(prompt_ids)} prompt + {parsed.params.max_tokens} max_tokens)",
                param="max_tokens" if len(prompt_ids) < limit else "prompt",
            )
        return prompt_ids

    def _admit(self) -> None:
        if self.health().status_code != 200:
            raise ApiError(
                503,
                "no live workers to serve this request; retry shortly",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        if self.in_flight >= self.settings.max_in_flight:
            raise ApiError(
                429,
                f"server busy: {self.in_flight} requests in flight; retry shortly",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )

    async def _generate(
        self, request_id, prompt_ids, parsed: ParsedRequest, endpoint: str
    ) -> AsyncIterator[GenerationChunk]:
        """The request's stream; counts the outcome however it ends."""
        self.in_flight += 1
        outcome = "cancelled"
        try:
            async for chunk in self.cluster.generate(
                prompt_ids, parsed.params, request_id=request_id
            ):
                yield chunk
            outcome = "ok"
        except (NoLiveWorkerError, TransferFailedError) as exc:
            outcome = "error"
            raise ApiError(
                503,
                str(exc),
                kind="service_unavailable",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            ) from exc
        except TimeoutError as exc:
            outcome = "timeout"
            raise ApiError(504, str(exc), kind="timeout") from exc
        except Exception:
            outcome = "error"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.observe_outcome(outcome, endpoint)

    async def _collect(self, stream, request_id, parsed: ParsedRequest, num_prompt: int) -> dict:
        text, last = [], None
        async for chunk in stream:
            text.append(chunk.text)
            last = chunk
        assert last is not None
        usage = _usage(num_prompt, last.num_output_tokens)
        if parsed.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "finish_reason": last.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {
                "index": 0,
                "text": "".join(text),
                "finish_reason": last.finish_reason,
                "logprobs": None,
            }
        body = _envelope(request_id, parsed, final=True)
        body.update(choices=[choice], usage=usage, pdserve_timings=last.timings)
        return body

    async def _sse(
        self, stream, request_id, parsed: ParsedRequest, num_prompt: int
    ) -> AsyncIterator[str]:
        first = True
        try:
            async for chunk in stream:
                if not chunk.text and not chunk.finished:
                    continue  # nothing to show yet (a partial UTF-8 character or held-back stop text)
                body = _envelope(request_id, parsed, final=False)
                body["choices"] = [_delta_choice(parsed, chunk, first)]
                first = False
                if parsed.continuous_usage:
                    body["usage"] = _usage(num_prompt, chunk.num_output_tokens)
                if chunk.finished:
                    body["pdserve_timings"] = chunk.timings
                yield format_sse_event(data_str=json.dumps(body))
                if chunk.finished and parsed.include_usage:
                    usage = _envelope(request_id, parsed, final=False)
                    usage.update(choices=[], usage=_usage(num_prompt, chunk.num_output_tokens))
                    yield format_sse_event(data_str=json.dumps(usage))
        except ApiError as exc:
            yield format_sse_event(data_str=json.dumps(exc.body()))
        yield format_sse_event(data_str="[DONE]")


def _envelope(request_id: str, parsed: ParsedRequest, final: bool) -> dict:
    if parsed.kind == "chat":
        kind = "chat.completion" if final else "chat.completion.chunk"
    else:
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": parsed.model}


def _delta_choice(parsed: ParsedRequest, chunk: GenerationChunk, first: bool) -> dict:
    if parsed.kind == "chat":
        delta = {"content": chunk.text}
        if first:
            delta["role"] = "assistant"  # with the first token, never in an empty chunk before it
        return {"index": 0, "delta": delta, "finish_reason": chunk.finish_reason, "logprobs": None}
    return {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason, "logprobs": None}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
