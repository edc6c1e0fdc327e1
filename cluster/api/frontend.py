"""OpenAI-compatible HTTP frontend over a `PDCluster` (FastAPI + uvicorn).

A request's path here: auth -> a provisional admission slot (429 + Retry-After when
the server is full, 503 when it cannot serve), before anything that scales with the
body -> the body read, bounded in size and time, and parsed in linear time
(cluster/api/request_body.py) -> validation, tokenization and the chat template on a worker
thread, so the event loop keeps serving others (4xx on bad input, the server keeps
serving) -> admission of every choice against the bounded number of in-flight
requests, counted from here until each closes -> `cluster.open_request` (400 for what
no worker can hold) -> `cluster.run` streamed out as SSE chunks or collected into one
response. Whichever way the client goes away (a closed stream, a dropped
non-streaming connection), the request is closed, which aborts it on its workers and
frees its KV blocks at once. On a stop signal the frontend drains (`cluster.api.drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.sse import format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import package_version
from cluster.api.choice_fanout import ChoiceFanout
from cluster.api.drain import Drain
from cluster.api.frontend_settings import FrontendSettings
from cluster.api.openai_protocol import (
    ApiError,
    ChatBody,
    CompletionBody,
    ParsedRequest,
    parse_body,
    validate_body,
)
from cluster.api.openai_responses import ChoiceWriter, EchoedPrompt, TokenNames, envelope, usage
from cluster.api.openapi import body_of, describe_bodies
from cluster.api.request_body import read_json
from cluster.api.tokenize_api import (
    DetokenizeBody,
    TokenizeBody,
    chat_prompt_ids,
    check_token_ids,
    detokenize,
    tokenize,
)
from cluster.api.tools import ToolCallReader
from cluster.control.metrics import ClusterMetrics
from cluster.flow.cluster import PDCluster, RequestTimeoutError
from cluster.flow.request import (
    CloseReason,
    ClusterRequest,
    GenerationChunk,
    RequestFailedError,
)
from cluster.flow.router import NoLiveWorkerError
from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)


_CLIENT_TAG = re.compile(r"[A-Za-z0-9._:-]{1,64}")
OUTCOME_BY_CLOSE = {
    CloseReason.FINISHED: "ok",
    CloseReason.CANCELLED: "cancelled",
    CloseReason.TIMEOUT: "timeout",
}
"""The outcome label of an HTTP request by its first non-finished choice's close reason;
any other reason counts as `error`."""
"""Close reasons as outcomes; any other (error, shutdown) counts as an error."""
STATUS_BY_KIND = {"invalid_request": 400, "transfer_failed": 503, "aborted": 503}
PUBLIC_FAILURES = {
    "transfer_failed": "moving the prompt's KV cache between workers failed; retry the request",
    "aborted": "a worker gave the request up; retry it",
}
"""What a client is told of a worker's failure: the worker's own text (paths, peers,
internals) goes to the log with the request id, never into the answer."""
DISCLOSED_ONLY_WITH_DETAILS = (
    "cached_tokens",
    "prefill_cached_tokens",
    "decode_reused_blocks",
    "kv_blocks_moved",
    "kv_bytes_saved",
    "route",
)
"""`pdserve_timings` fields sent only with `enable_prompt_tokens_details`."""


def build_app(
    cluster: PDCluster,
    settings: FrontendSettings | None = None,
    metrics: ClusterMetrics | None = None,
) -> FastAPI:
    settings = settings or FrontendSettings.from_env()
    metrics = metrics or ClusterMetrics(cluster.controller)
    cluster.on_finish.append(lambda req: metrics.observe_timeline(req.timeline))
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
        handler.authorize_admin(request)
        return await handler.workers()

    @app.get("/admin/steps")
    async def admin_steps(request: Request, last: int = 512):
        handler.authorize_admin(request)
        return await cluster.controller.step_traces(max(0, min(last, 4096)))

    @app.get("/v1/models")
    async def models(request: Request):
        handler.authorize(request)
        return handler.models()

    @app.get("/v1/models/{model}")
    async def model(request: Request, model: str):
        handler.authorize(request)
        handler.check_model(model)
        return handler.models()["data"][0]

    @app.post("/tokenize", openapi_extra=body_of(TokenizeBody))
    async def tokenize_route(request: Request):
        body = await handler.read_body(request, TokenizeBody)
        return tokenize(cluster.tokenizer, body, cluster.max_model_len)

    @app.post("/detokenize", openapi_extra=body_of(DetokenizeBody))
    async def detokenize_route(request: Request):
        return detokenize(cluster.tokenizer, await handler.read_body(request, DetokenizeBody))

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.post("/v1/completions", openapi_extra=body_of(CompletionBody))
    async def completions(request: Request):
        return await handler.handle(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=body_of(ChatBody))
    async def chat_completions(request: Request):
        return await handler.handle(request, "chat")

    describe_bodies(app, [CompletionBody, ChatBody, TokenizeBody, DetokenizeBody])
    return app


class OpenAIHandler:
    def __init__(self, cluster: PDCluster, settings: FrontendSettings, metrics: ClusterMetrics):
        self.cluster = cluster
        self.settings = settings
        self.metrics = metrics
        self.in_flight = 0
        """Admitted choices not yet closed."""
        self.preparing = 0
        """Requests holding a provisional slot: body, parse and tokenization under way."""
        self.drain = Drain()
        aliases = settings.served_model_names
        self.model_name = aliases[0] if aliases else cluster.model_id
        """What /v1/models lists, and the `model` of a request that names none."""
        self.model_names = set(aliases) or {cluster.model_id, cluster.config.model}
        self.names = TokenNames(cluster.tokenizer)

    # --- small endpoints --------------------------------------------------------------

    def live_workers(self) -> dict[str, int]:
        return {
            role: len(self.cluster.router.live(role)) for role in ("prefill", "decode", "colocated")
        }

    def health(self) -> JSONResponse:
        """200 while requests can be served. With decode workers but no prefill worker the
        cluster is `degraded`: decode workers prefill prompts themselves. 503 `draining`
        once the server is stopping."""
        live = self.live_workers()
        if self.drain.started:
            status = "draining"
        elif live["colocated"] or (live["prefill"] and live["decode"]):
            status = "ok"
        elif live["decode"]:
            status = "degraded"
        else:
            status = "unavailable"
        return JSONResponse(
            {"status": status, "workers": live},
            status_code=503 if status in ("unavailable", "draining") else 200,
        )

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "max_model_len": self.cluster.max_model_len,
                }
            ],
        }

    async def workers(self) -> dict:
        """Drills and operators: every worker's liveness, process, restarts, KV held, and
        how each decode worker's last import from each prefill worker arrived. Liveness is
        read when the call arrives, before the workers' states are gathered (a busy
        engine thread answers after its step, seconds under load): a drill times it
        against the moment it asked."""
        controller = self.cluster.controller
        rows = [_liveness(worker) for worker in controller.workers.values()]
        states = await controller.debug_states()
        for row in rows:
            row.update(states.get(row["worker_id"], {}))
        return {
            "workers": rows,
            "prestarted": controller.prestarted.counts(),
            "frontend_pid": os.getpid(),
        }

    def authorize(self, request: Request) -> None:
        """The tenants' endpoints: the API key, where one is set."""
        if self.settings.api_key:
            _check_bearer(request, self.settings.api_key)

    def authorize_admin(self, request: Request) -> None:
        """/admin/*: the admin key; refused outright when only tenants have a key."""
        if self.settings.admin_api_key:
            _check_bearer(request, self.settings.admin_api_key)
        elif self.settings.api_key:
            raise ApiError(
                403, "the admin endpoints are off: start the server with --admin-api-key"
            )

    # --- generation -------------------------------------------------------------------

    async def handle(self, request: Request, kind: str):
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            opened = await self._open(request, kind)
        except ApiError as exc:
            self.metrics.observe_outcome(
                "rejected" if exc.status in (429, 503) else "error", endpoint
            )
            raise
        self._count_outcome(opened.reqs, endpoint)
        fanout = ChoiceFanout(opened.reqs, opened.parsed.n, self._chunks)
        if opened.parsed.stream:
            return OwnedStreamingResponse(
                self._sse(opened, fanout),
                on_close=lambda reason: _close_all(opened.reqs, reason),
                cut=self.drain.cut,
                media_type="text/event-stream",
            )
        return await self._collect_until_disconnect(request, opened, fanout)

    async def _open(self, request: Request, kind: str) -> Opened:
        """Everything before the request is admitted; raises ApiError, never anything else
        for client input."""
        self.authorize(request)
        self._reserve()
        try:
            return await self._prepare(request, kind)
        except ApiError:
            raise
        except InvalidRequestError as exc:
            raise ApiError(400, exc.message, param="prompt") from None
        except Exception as exc:  # a bug, not the client: a JSON 500, the server keeps going
            logger.exception("request could not be opened")
            raise ApiError(500, f"internal error: {type(exc).__name__}") from None
        finally:
            self.preparing -= 1

    async def _prepare(self, request: Request, kind: str) -> Opened:
        """Read, parse and tokenize under the provisional slot; then admit every choice."""
        settings = self.settings
        body = await read_json(request, settings.max_body_bytes, settings.read_timeout_s)
        parsed, prompts = await asyncio.to_thread(self._parse, kind, body)
        request_id = _request_id(kind, request.headers.get("x-request-id"))
        self._check_capacity(parsed.num_choices, holding=1)
        reqs = [
            self._open_choice(parsed, prompts, index, request_id)
            for index in range(parsed.num_choices)
        ]
        self.in_flight += len(reqs)
        return Opened(request_id, parsed, prompts, reqs)

    def _parse(self, kind: str, body) -> tuple[ParsedRequest, list[list[int]]]:
        """On a worker thread: validation (grammars compiled), the chat template and
        tokenization, whose cost grows with the body."""
        parsed = self._named(parse_body(kind, body, self.settings.limits))
        prompts = [self._prompt_ids(parsed, prompt) for prompt in parsed.prompts]
        self._check_named_tokens(parsed)
        return parsed, prompts

    def _count_outcome(self, reqs: list[ClusterRequest], endpoint: str) -> None:
        """Every choice frees its admission slot when it closes; the HTTP request's
        outcome is counted once, when its last choice closed."""
        open_choices = [len(reqs)]

        def closed(req: ClusterRequest) -> None:
            self.in_flight -= 1
            open_choices[0] -= 1
            if req.close_reason != CloseReason.FINISHED:
                outcomes.append(req.close_reason)
            if open_choices[0] == 0:
                reason = outcomes[0] if outcomes else CloseReason.FINISHED
                self.metrics.observe_outcome(OUTCOME_BY_CLOSE.get(reason, "error"), endpoint)

        outcomes: list[CloseReason | None] = []
        for req in reqs:
            req.on_close.append(closed)

    async def read_body(self, request: Request, model_cls):
        """An authorized request's body as `model_cls`, its `model` (if sent) checked."""
        self.authorize(request)
        settings = self.settings
        raw = await read_json(request, settings.max_body_bytes, settings.read_timeout_s)
        body = validate_body(model_cls, raw)
        if body.model is not None:
            self.check_model(body.model)
        return body

    def _named(self, parsed: ParsedRequest) -> ParsedRequest:
        """A request's `model` checked, or this server's name where it gives none (as
        vLLM takes it)."""
        if parsed.model is None:
            return dataclasses.replace(parsed, model=self.model_name)
        self.check_model(parsed.model)
        return parsed

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise ApiError(
                404,
                f"model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                kind="model_not_found",
            )

    def _prompt_ids(self, parsed: ParsedRequest, prompt) -> list[int]:
        tokenizer = self.cluster.tokenizer
        if parsed.kind == "chat":
            return chat_prompt_ids(tokenizer, prompt, parsed.tools, parsed.template_options)
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        check_token_ids(tokenizer, prompt, "prompt")
        return list(prompt)

    def _open_choice(
        self, parsed: ParsedRequest, prompts: list[list[int]], index: int, request_id: str
    ) -> ClusterRequest:
        """Choice `index` of the request: prompt index // n, sampled with seed + index % n,
        its default max_tokens cut to the context its prompt leaves (when that leaves
        room for min_tokens: otherwise `open_request` refuses it as too long)."""
        prompt_ids, params = prompts[index // parsed.n], _choice_params(parsed, index % parsed.n)
        room = self.cluster.max_model_len - len(prompt_ids)
        if not parsed.max_tokens_sent and max(1, params.min_tokens) <= room < params.max_tokens:
            params = dataclasses.replace(params, max_tokens=room)
        return self.cluster.open_request(
            prompt_ids, params, _choice_id(request_id, index, parsed.num_choices)
        )

    def _check_named_tokens(self, parsed: ParsedRequest) -> None:
        """logit_bias and stop_token_ids name tokens of the served vocabulary: an id past it
        would otherwise be dropped in silence (the bias) or never match (the stop)."""
        tokenizer = self.cluster.tokenizer
        check_token_ids(
            tokenizer, [token_id for token_id, _ in parsed.params.logit_bias], "logit_bias"
        )
        check_token_ids(tokenizer, parsed.params.stop_token_ids, "stop_token_ids")

    def _reserve(self) -> None:
        """A provisional slot, taken before the body is read: a full or stopping server
        refuses a request before it costs anything, and bodies in the reading count
        against `max_in_flight` like the requests they become."""
        if self.drain.started:
            raise Drain.error()
        if self.health().status_code != 200:
            raise ApiError(
                503,
                "no live workers to serve this request; retry shortly",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        self._check_capacity(1)
        self.preparing += 1

    def _check_capacity(self, count: int, holding: int = 0) -> None:
        """429 unless `count` more fit, besides the `holding` slots the caller has."""
        taken = self.in_flight + self.preparing - holding
        if taken + count > self.settings.max_in_flight:
            raise ApiError(
                429,
                f"server busy: {taken} requests in flight; retry shortly",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )

    async def _chunks(self, req: ClusterRequest) -> AsyncIterator[GenerationChunk]:
        """The request's stream, with every failure turned into the ApiError to send."""
        try:
            async for chunk in self.cluster.run(req):
                yield chunk
        except Exception as exc:
            raise self._api_error(exc) from exc

    def _api_error(self, exc: Exception) -> ApiError:
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if isinstance(exc, NoLiveWorkerError):
            return ApiError(503, str(exc), kind="service_unavailable", headers=retry)
        if isinstance(exc, RequestTimeoutError):
            return ApiError(504, str(exc), kind="timeout")
        if isinstance(exc, RequestFailedError):
            status = STATUS_BY_KIND.get(exc.kind, 500)
            if status < 500:
                return ApiError(status, exc.message)
            logger.warning("request %s failed (%s): %s", exc.request_id, exc.kind, exc.message)
            message = PUBLIC_FAILURES.get(exc.kind, "internal error")
            headers = retry if status == 503 else None
            return ApiError(status, f"{message} (request {exc.request_id})", headers=headers)
        logger.error("request failed", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}")

    def _writers(self, opened: Opened) -> list[ChoiceWriter]:
        parsed = opened.parsed
        writers = []
        for index in range(parsed.num_choices):
            prompt_index = index // parsed.n
            echo = None
            if parsed.echo:
                prompt = parsed.prompts[prompt_index]
                ids = opened.prompt_ids[prompt_index]
                text = prompt if isinstance(prompt, str) else self.cluster.tokenizer.decode(ids)
                echo = EchoedPrompt(text, ids)
            tools = None
            if parsed.tool_choice is not None and parsed.tool_choice.mode != "none":
                tools = ToolCallReader(parsed.tool_choice, self.settings.tool_call_parser)
            writers.append(ChoiceWriter(index, parsed, self.names, echo=echo, tools=tools))
        return writers

    async def _collect_until_disconnect(
        self, request: Request, opened: Opened, fanout: ChoiceFanout
    ):
        """A non-streaming request, closed as soon as its client goes away, or answered
        with a 503 when the server's drain runs out first."""
        collect = asyncio.ensure_future(self._collect(opened, fanout))
        gone = asyncio.ensure_future(_client_gone(request))
        cut = self.drain.cut
        try:
            await asyncio.wait({collect, gone, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                reason = CloseReason.SHUTDOWN if cut.done() else CloseReason.CANCELLED
                _close_all(opened.reqs, reason)
                with contextlib.suppress(asyncio.CancelledError, ApiError):
                    await collect
        if collect.cancelled():
            if cut.done():
                raise Drain.error()
            return Response(status_code=499)  # nobody is listening any more
        return collect.result()

    async def _collect(self, opened: Opened, fanout: ChoiceFanout) -> dict:
        writers = self._writers(opened)
        stream = fanout.stream()
        try:
            async for index, chunk in stream:
                writers[index].add(chunk)
        finally:
            await stream.aclose()  # a cancelled collect stops every choice now
        body = envelope(opened.request_id, opened.parsed, final=True)
        body.update(
            choices=[w.final() for w in writers],
            usage=self._usage(opened, writers),
            pdserve_timings=self._disclosed(writers[0].timings),
        )
        if len(writers) > 1:
            body["pdserve_choice_timings"] = [self._disclosed(w.timings) for w in writers]
        return body

    def _disclosed(self, timings: dict) -> dict:
        """`pdserve_timings` as this server discloses it (`enable_prompt_tokens_details`)."""
        if self.settings.enable_prompt_tokens_details:
            return timings
        return {k: v for k, v in timings.items() if k not in DISCLOSED_ONLY_WITH_DETAILS}

    def _usage(self, opened: Opened, writers: list[ChoiceWriter]) -> dict:
        """Prompt tokens once per prompt (its n choices share it), completion tokens of
        every choice; cached tokens as the prompts' first choices found them."""
        leaders = opened.reqs[:: opened.parsed.n]
        cached = sum(req.timeline.cached_tokens or 0 for req in leaders)
        return usage(
            sum(len(ids) for ids in opened.prompt_ids),
            sum(w.num_output_tokens for w in writers),
            cached if self.settings.enable_prompt_tokens_details else None,
        )

    async def _sse(self, opened: Opened, fanout: ChoiceFanout) -> AsyncIterator[str]:
        parsed = opened.parsed
        writers = self._writers(opened)
        stream = fanout.stream()
        try:
            async for index, chunk in stream:
                choice = writers[index].delta(chunk)
                if choice is None:
                    continue  # nothing to show yet (a partial UTF-8 character, held-back text)
                body = envelope(opened.request_id, parsed, final=False)
                body["choices"] = [choice]
                if parsed.continuous_usage:
                    body["usage"] = self._usage(opened, writers)
                if chunk.finished:
                    body["pdserve_timings"] = self._disclosed(chunk.timings)
                yield format_sse_event(data_str=json.dumps(body))
            if parsed.include_usage:
                totals = envelope(opened.request_id, parsed, final=False)
                totals.update(choices=[], usage=self._usage(opened, writers))
                yield format_sse_event(data_str=json.dumps(totals))
        except ApiError as exc:
            yield format_sse_event(data_str=json.dumps(exc.body()))
        finally:
            await stream.aclose()
        yield format_sse_event(data_str="[DONE]")


@dataclass
class Opened:
    """An admitted HTTP request: its parse and one owner per choice."""

    request_id: str
    parsed: ParsedRequest
    prompt_ids: list[list[int]]
    """Token ids of each prompt (after the chat template)."""
    reqs: list[ClusterRequest]
    """Choice i answers prompt i // n."""


def _check_bearer(request: Request, key: str) -> None:
    sent = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(sent, f"Bearer {key}".encode()):
        raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")


def _close_all(reqs: list[ClusterRequest], reason: CloseReason) -> None:
    for req in reqs:
        req.close(reason)


def _choice_params(parsed: ParsedRequest, offset: int):
    """Choice `offset` of a prompt samples with the request's seed + offset."""
    params = parsed.params
    if offset == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + offset)


def _choice_id(request_id: str, index: int, count: int) -> str:
    return request_id if count == 1 else f"{request_id}-{index}"


class OwnedStreamingResponse(StreamingResponse):
    """A stream that always learns when its client goes away, and always runs
    `on_close(reason)` at the end, even when the client left before the first byte
    (plain StreamingResponse notices a disconnect only on its next send under newer
    ASGI servers, and never starts a body iterator it did not reach). When `cut` (the
    server's drain running out) comes first, the stream ends with a 503 error event
    and `[DONE]`, and `on_close` gets `shutdown`."""

    def __init__(
        self, content, on_close: Callable[[CloseReason], None], cut: asyncio.Future, **kwargs
    ):
        super().__init__(content, **kwargs)
        self.on_close = on_close
        self.cut = cut
        self.started = False
        """The response's head has gone out (a cut then ends the body, else sends a 503)."""

    async def __call__(self, scope, receive, send) -> None:
        reason = CloseReason.CANCELLED  # a finished stream closed its requests already
        try:
            stream = asyncio.ensure_future(self.stream_response(self._noting_start(send)))
            gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
            try:
                done, _ = await asyncio.wait(
                    {stream, gone, self.cut}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for task in (stream, gone):
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await stream
            if self.cut in done and not done & {stream, gone}:
                reason = CloseReason.SHUTDOWN
                with contextlib.suppress(OSError):
                    await self._end_cut(scope, receive, send)
        finally:
            self.on_close(reason)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()

    def _noting_start(self, send):
        async def noted(message) -> None:
            self.started = self.started or message["type"] == "http.response.start"
            await send(message)

        return noted

    async def _end_cut(self, scope, receive, send) -> None:
        """The 503 of a cut: the rest of the SSE body, or the whole answer when the
        response's head had not gone out."""
        error = Drain.error()
        if not self.started:
            answer = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
            await answer(scope, receive, send)
            return
        events = format_sse_event(data_str=json.dumps(error.body()))
        events += format_sse_event(data_str="[DONE]")
        await send({"type": "http.response.body", "body": events, "more_body": False})


def _liveness(worker) -> dict:
    """One `/admin/workers` row's view of a worker from the controller's own records."""
    load = worker.load
    return {
        "worker_id": worker.worker_id,
        "role": worker.role,
        "alive": worker.alive,
        "standby": worker.standby,
        "generation": worker.generation,
        "restarts": worker.restarts,
        "dead_for_s": _since(worker.dead_since),
        "alive_for_s": _since(worker.alive_since) if worker.alive else None,
        "pid": load.pid if load else None,
        "tp_size": load.tp_size if load else None,
        "rank_pids": [load.pid, *load.rank_pids] if load else [],
        "cpu_cores": list(load.cpu_cores) if load else None,
        "node_id": load.node_id if load else None,
        "last_transfer": load.last_transfer if load else {},
    }


def _since(stamp: float | None) -> float | None:
    return None if stamp is None else time.monotonic() - stamp


def _request_id(kind: str, client_tag: str | None) -> str:
    """A fresh id; a client's `X-Request-Id` (when sane) is kept inside it, so the
    client can find its request in logs and `/admin/workers`."""
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    if client_tag and _CLIENT_TAG.fullmatch(client_tag):
        return f"{prefix}-{client_tag}-{uuid.uuid4().hex[:8]}"
    return f"{prefix}-{uuid.uuid4().hex}"


async def _client_gone(request: Request) -> None:
    """Returns when the client of a request whose body was read disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
