"""OpenAI request bodies, validated: what real clients and benchmark tools send.

`read_json` takes the raw body whatever its Content-Type (as vLLM does), bounds its
size and nesting before parsing, and refuses text that cannot be encoded (a lone
surrogate). Parsing turns the JSON into a `ParsedRequest` (prompt ids +
SamplingParams) or raises `ApiError` with the status, message and offending parameter. Unknown fields
are ignored like OpenAI does, except fields whose silent loss would change results
(`n` > 1, `logprobs`, `best_of`, `tools`, ...), which are refused with a 400.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling_params import MAX_TOKENS_LIMIT, SamplingParams


class ApiError(Exception):
    """An error the client caused or must retry; rendered as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _KIND_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers or {}
        super().__init__(message)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


_KIND_BY_STATUS = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "service_unavailable",
}

_UNSUPPORTED = {
    "logprobs": "logprobs are not supported by this server",
    "top_logprobs": "logprobs are not supported by this server",
    "best_of": "best_of is not supported; send separate requests",
    "tools": "tool calling is not supported by this server",
    "functions": "function calling is not supported by this server",
    "response_format": "response_format is not supported by this server",
    "echo": "echo is not supported by this server",
    "suffix": "suffix is not supported by this server",
    "logit_bias": "logit_bias is not supported by this server",
}


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (OpenAI bodies need ~6)."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


async def read_json(request, max_body_bytes: int) -> Any:
    """The request's body as JSON, or ApiError 413/400."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise ApiError(413, f"request body over {max_body_bytes} bytes")
    raw = await request.body()
    if len(raw) > max_body_bytes:
        raise ApiError(413, f"request body over {max_body_bytes} bytes")
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not UTF-8: {exc}") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, "request body holds a string that is not valid Unicode (a lone surrogate)"
        ) from None
    return body


def json_depth(text: str) -> int:
    """Deepest bracket nesting outside strings, without parsing (so no recursion)."""
    structure = _JSON_STRING.sub('""', text).encode("utf-8", "surrogatepass")
    codes = np.frombuffer(structure, dtype=np.uint8)
    if not codes.size:
        return 0
    steps = ((codes == ord("[")) | (codes == ord("{"))).astype(np.int32)
    steps -= ((codes == ord("]")) | (codes == ord("}"))).astype(np.int32)
    return int(np.cumsum(steps).max())


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)
    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None


class ChatBody(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


@dataclass
class ParsedRequest:
    kind: Literal["completion", "chat"]
    model: str
    prompt: str | list[int] | list[dict]
    """Text or token ids (completions) or messages (chat)."""
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool


def parse_body(kind: str, body: Any) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, False, 0, []):
            raise ApiError(400, why, param=name)
    model_cls = ChatBody if kind == "chat" else CompletionBody
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"invalid '{param}': {first.get('msg')}", param=param) from None
    if parsed.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if parsed.presence_penalty or parsed.frequency_penalty:
        raise ApiError(
            400, "presence/frequency penalties are not supported", param="presence_penalty"
        )
    prompt = _prompt_of(kind, parsed)
    options = parsed.stream_options or StreamOptions()
    return ParsedRequest(
        kind=kind,
        model=parsed.model,
        prompt=prompt,
        params=_sampling_params(parsed),
        stream=parsed.stream,
        include_usage=options.include_usage,
        continuous_usage=options.continuous_usage_stats,
    )


def _prompt_of(kind: str, parsed) -> str | list[int] | list[dict]:
    if kind == "chat":
        if not parsed.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        return [{"role": m.role, "content": _content_text(m.content)} for m in parsed.messages]
    prompt = parsed.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise ApiError(
                400,
                "batched prompts are not supported; send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return prompt


def _content_text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _sampling_params(parsed) -> SamplingParams:
    max_tokens = getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens
    if max_tokens is None:
        max_tokens = 256
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise ApiError(
            400,
            f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {max_tokens}",
            param="max_tokens",
        )
    stop = parsed.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400,
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            "characters each",
            param="stop",
        )
    if parsed.top_k < -1:
        raise ApiError(
            400, f"top_k must be -1 or 0 (disabled) or positive, got {parsed.top_k}", param="top_k"
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k if parsed.top_k > 0 else 0,
            seed=parsed.seed,
            stop=stops,
            ignore_eos=parsed.ignore_eos,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
