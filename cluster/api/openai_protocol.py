"""OpenAI request bodies, validated: what real clients and benchmark tools send.

The body arrives as JSON (cluster/api/request_body.py read it, bounded). Parsing turns it
into a `ParsedRequest` (prompt ids + SamplingParams) or raises `ApiError` with the
status, message and offending parameter. Unknown fields are ignored like OpenAI does,
except fields whose silent loss would change results (`best_of`, `audio`, ...), which
are refused with a 400. The sampling side of a body
(penalties, logprobs, structured output, tool choice) is read by cluster/api/openai_params.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.api.request_limits import DEFAULT_LIMITS, RequestLimits
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
    408: "timeout",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}

_UNSUPPORTED = {
    "best_of": "best_of is not supported (deprecated upstream); use n, or send separate "
    "requests and pick",
    "functions": "the legacy 'functions' parameter is not supported; use 'tools'",
    "function_call": "the legacy 'function_call' parameter is not supported; use 'tool_choice'",
    "suffix": "suffix is not supported by this server",
    "audio": "audio output is not supported by this server",
    "chat_template": "a chat template per request is not supported; the model's own renders "
    "every chat",
    "use_beam_search": "beam search is not supported by this server",
    "bad_words": "bad_words is not supported; logit_bias bans single tokens",
    "allowed_token_ids": "allowed_token_ids is not supported; guided_choice or guided_regex "
    "constrain the output",
    "prompt_logprobs": "prompt_logprobs is not supported; a completions request with echo and "
    "logprobs returns the prompt's",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported: send the prompt to keep",
}
"""Fields whose silent loss would change results: refused with a 400 (best_of 1 is fine)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's newer spelling of the guided_* fields."""

    model_config = ConfigDict(extra="ignore")
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)
    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None
    """vLLM's extension: prompts share cached prefix blocks only with the same salt."""


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateOptions(BaseModel):
    """vLLM's options for rendering a chat (chat requests and /tokenize)."""

    add_generation_prompt: bool = True
    """End with the assistant turn opened, for the model to answer."""
    continue_final_message: bool = False
    """Leave the final (assistant) message open, for the model to go on with it; needs
    `add_generation_prompt: false`."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the template (e.g. Qwen3's `enable_thinking`)."""


class ChatBody(_Common, ChatTemplateOptions):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


@dataclass
class ParsedRequest:
    kind: Literal["completion", "chat"]
    model: str | None
    """As the body names it; the frontend fills in its served name where that is None."""
    prompts: list[str | list[int] | list[dict]]
    """Completions: one entry per batched prompt (text or token ids); chat: one list of
    messages, ready for the chat template."""
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    n: int = 1
    """Choices per prompt; choice i of a seeded request samples with seed + i."""
    echo: bool = False
    """Completions: the prompt's text (and logprobs) lead each choice."""
    echo_only: bool = False
    """`max_tokens: 0` with echo: the token generated to score the prompt is not returned."""
    logprobs: int | None = None
    """Alternatives per output position to return (None: no logprobs)."""
    tools: list[dict] | None = None
    tool_choice: Any = None
    """`cluster.api.tools.ToolChoice` of a chat request with tools, else None."""
    template_options: dict = field(default_factory=dict)
    """Chat: what the template renders with besides messages and tools."""
    max_tokens_sent: bool = True
    """False: `params.max_tokens` is the default, and shrinks to a long prompt's room."""

    @property
    def prompt(self) -> str | list[int] | list[dict]:
        return self.prompts[0]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def parse_body(kind: str, body: Any, limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """A completion or chat body as what the cluster runs, or ApiError; `limits` bound
    what one request may ask for (the server's flags; a 400 names the one exceeded)."""
    from cluster.api.openai_params import request_of

    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, False, 0, [], 1 if name == "best_of" else None):
            raise ApiError(400, why, param=name)
    parsed = validate_body(ChatBody if kind == "chat" else CompletionBody, body)
    return request_of(kind, parsed, limits)


def validate_body(model_cls: type[BaseModel], body: Any):
    """`body` validated into `model_cls`, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"invalid '{param}': {first.get('msg')}", param=param) from None


def check_sampling(**fields) -> SamplingParams:
    """SamplingParams, with a bad value turned into a 400."""
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), param=name if name in fields else None) from None


DEFAULT_MAX_TOKENS = 256
"""max_tokens of a request that sends none, where its prompt leaves that much room; else
the room left (as vLLM fills the context), so a long prompt is not refused for a limit
its client never set."""


def max_tokens_of(parsed) -> int | None:
    """The body's max_tokens (or max_completion_tokens), checked; None where it sends none."""
    max_tokens = getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens
    if max_tokens is None:
        return None
    if not 0 <= max_tokens <= MAX_TOKENS_LIMIT or (max_tokens == 0 and not _echoes(parsed)):
        raise ApiError(
            400,
            f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {max_tokens}",
            param="max_tokens",
        )
    return max_tokens


def _echoes(parsed) -> bool:
    return bool(getattr(parsed, "echo", False))
