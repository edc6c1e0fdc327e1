"""From a validated OpenAI body to what the cluster runs: prompts, choices, and the
SamplingParams of each, with vLLM's extensions.

Called by `openai_protocol.parse_body` once per request, before anything is admitted,
so every mistake is a 400 naming its parameter:
    sampling and penalties -> SamplingParams fields (engine/sampling_params.py)
    logprobs: completions `logprobs: k`; chat `logprobs: true` + `top_logprobs: k`;
      completions `echo` with logprobs asks for prompt logprobs too
    structured output: `response_format` (json_object, json_schema), vLLM's
      `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (Lark) or
      `structured_outputs`, and the constraint a tool choice implies (cluster/api/tools.py);
      at most one of them, checked by compiling the grammar (engine/structured.py)
    batched prompts (completions) and `n` -> `ParsedRequest.prompts` and `.n`.
What one request may ask for is bounded by the server's `RequestLimits`
(cluster/api/request_limits.py): choices, stop strings, stop token ids (duplicates folded
first) and logit_bias entries.
"""

from __future__ import annotations

import contextlib
import json

from cluster.api.openai_protocol import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ChatBody,
    ParsedRequest,
    StreamOptions,
    check_sampling,
    max_tokens_of,
)
from cluster.api.request_body import MAX_JSON_DEPTH, json_depth
from cluster.api.request_limits import RequestLimits
from cluster.api.tools import ToolChoice, tool_grammar
from engine.sampling_params import MAX_CACHE_SALT_CHARS, MAX_LOGPROBS, StructuredSpec


def request_of(kind: str, parsed, limits: RequestLimits) -> ParsedRequest:
    prompts = _prompts_of(kind, parsed)
    most = limits.max_choices
    if not 1 <= parsed.n <= most or len(prompts) * parsed.n > most:
        raise ApiError(
            400,
            f"n x prompts must be between 1 and {most}, got n={parsed.n} x {len(prompts)} prompts",
            param="n",
        )
    tools, choice = _tools_of(parsed) if kind == "chat" else (None, None)
    logprobs, prompt_logprobs = _logprobs_of(kind, parsed)
    sent_max_tokens = max_tokens_of(parsed)
    max_tokens = DEFAULT_MAX_TOKENS if sent_max_tokens is None else sent_max_tokens
    params = check_sampling(
        max_tokens=max(1, max_tokens),
        prompt_logprobs=prompt_logprobs,
        logprobs=logprobs,
        structured=_structured_of(parsed, tools, choice),
        **_sampling_fields(parsed, limits),
    )
    options = parsed.stream_options or StreamOptions()
    return ParsedRequest(
        kind=kind,
        model=parsed.model,
        prompts=prompts,
        params=params,
        stream=parsed.stream,
        include_usage=options.include_usage,
        continuous_usage=options.continuous_usage_stats,
        n=parsed.n,
        echo=bool(getattr(parsed, "echo", False)),
        echo_only=max_tokens == 0,
        logprobs=logprobs,
        tools=tools,
        tool_choice=choice,
        template_options=template_options(parsed) if kind == "chat" else {},
        max_tokens_sent=sent_max_tokens is not None,
    )


_TEMPLATE_CALL_ARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
     "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
     "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message"}
)  # fmt: skip
"""Arguments of transformers' apply_chat_template: not template variables."""


def template_options(parsed) -> dict:
    """The keyword arguments a chat renders with (`Tokenizer.apply_chat_template`), from a
    body's `ChatTemplateOptions` fields."""
    if parsed.add_generation_prompt and parsed.continue_final_message:
        raise ApiError(
            400,
            "continue_final_message needs add_generation_prompt: false",
            param="continue_final_message",
        )
    variables = parsed.chat_template_kwargs or {}
    clashing = sorted(_TEMPLATE_CALL_ARGS & variables.keys())
    if clashing:
        raise ApiError(
            400, f"chat_template_kwargs may not set {', '.join(clashing)}", "chat_template_kwargs"
        )
    return {
        **variables,
        "add_generation_prompt": parsed.add_generation_prompt,
        "continue_final_message": parsed.continue_final_message,
    }


def _prompts_of(kind: str, parsed) -> list:
    if kind == "chat":
        if not parsed.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        return [[message_dict(m) for m in parsed.messages]]
    prompt = parsed.prompt
    batched = isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str))
    prompts = list(prompt) if batched else [prompt]
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return prompts


def message_dict(message) -> dict:
    """A message as chat templates read it; tool call arguments as objects (templates
    serialize them themselves)."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out = {"role": message.role, "content": content or ""}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    return out


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError, RecursionError):
            parsed = json.loads(arguments)
            # The template walks what it is given: arguments nested past the body's own
            # bound stay the string they came as.
            if json_depth(parsed) <= MAX_JSON_DEPTH:
                function["arguments"] = parsed
    return {**call, "function": function}


def _sampling_fields(parsed, limits: RequestLimits) -> dict:
    stop = parsed.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > limits.max_stop_strings or any(
        len(s) > limits.max_stop_string_chars for s in stops
    ):
        raise ApiError(
            400,
            f"stop takes at most {limits.max_stop_strings} strings of at most "
            f"{limits.max_stop_string_chars} characters each",
            param="stop",
        )
    salt = parsed.cache_salt
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(
            400,
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            param="cache_salt",
        )
    if parsed.top_k < -1:
        raise ApiError(
            400, f"top_k must be -1 or 0 (disabled) or positive, got {parsed.top_k}", param="top_k"
        )
    return dict(
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        top_k=parsed.top_k if parsed.top_k > 0 else 0,
        min_p=parsed.min_p,
        seed=parsed.seed,
        stop=stops,
        ignore_eos=parsed.ignore_eos,
        include_stop_str_in_output=parsed.include_stop_str_in_output,
        skip_special_tokens=parsed.skip_special_tokens,
        min_tokens=parsed.min_tokens,
        presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty,
        repetition_penalty=parsed.repetition_penalty,
        logit_bias=_logit_bias(parsed.logit_bias, limits.max_logit_bias_entries),
        stop_token_ids=_stop_token_ids(parsed.stop_token_ids, limits.max_stop_token_ids),
        cache_salt=salt,
    )


def _logit_bias(bias: dict[str, float] | None, most: int) -> tuple[tuple[int, float], ...]:
    if bias and len(bias) > most:
        raise ApiError(
            400, f"logit_bias maps at most {most} token ids, got {len(bias)}", param="logit_bias"
        )
    pairs = []
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise ApiError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
        pairs.append((int(key), max(-100.0, min(100.0, float(value)))))
    return tuple(pairs)


def _stop_token_ids(token_ids: list[int] | None, most: int) -> tuple[int, ...]:
    """The distinct ids in the order sent: a repeated id stops no differently."""
    distinct = tuple(dict.fromkeys(token_ids or ()))
    if len(distinct) > most:
        raise ApiError(
            400,
            f"stop_token_ids takes at most {most} distinct ids, got {len(distinct)}",
            param="stop_token_ids",
        )
    return distinct


def _logprobs_of(kind: str, parsed) -> tuple[int | None, int | None]:
    """(alternatives per output token, per prompt token); None where not asked."""
    if kind == "chat":
        if parsed.top_logprobs is not None and not parsed.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        count = (parsed.top_logprobs or 0) if parsed.logprobs else None
        param = "top_logprobs"
    else:
        count, param = parsed.logprobs, "logprobs"
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be between 0 and {MAX_LOGPROBS}", param=param)
    prompt_count = count if kind == "completion" and parsed.echo and count is not None else None
    return count, prompt_count


def _tools_of(parsed: ChatBody) -> tuple[list[dict] | None, ToolChoice | None]:
    choice = parsed.tool_choice
    if not parsed.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    tools = [t.model_dump(exclude_none=True) for t in parsed.tools]
    names = [t["function"]["name"] for t in tools]
    parallel = parsed.parallel_tool_calls
    if choice is None or isinstance(choice, str):
        return tools, ToolChoice(choice or "auto", parallel=parallel)
    if choice.function.name not in names:
        raise ApiError(
            400, f"tool_choice names '{choice.function.name}', not among the tools", "tool_choice"
        )
    return tools, ToolChoice("named", choice.function.name, parallel)


def _structured_of(parsed, tools, choice: ToolChoice | None) -> StructuredSpec | None:
    asked = _asked_structures(parsed)
    asked.append(("tool_choice", tool_grammar(tools, choice) if tools else None))
    specs = [(param, spec) for param, spec in asked if spec is not None]
    if len(specs) > 1:
        names = ", ".join(param for param, _ in specs)
        raise ApiError(400, f"at most one output constraint per request, got {names}", specs[1][0])
    if not specs:
        return None
    param, spec = specs[0]
    from engine.structured import check_spec

    try:
        check_spec(spec)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None
    return spec


def _asked_structures(parsed) -> list[tuple[str, StructuredSpec | None]]:
    fmt = parsed.response_format
    asked = [("response_format", _format_spec(fmt) if fmt else None)]
    guided = parsed.structured_outputs
    json_value = parsed.guided_json if parsed.guided_json is not None else (guided and guided.json_)
    regex = parsed.guided_regex or (guided and guided.regex)
    choice = (
        parsed.guided_choice if parsed.guided_choice is not None else (guided and guided.choice)
    )
    if choice is not None and not choice:
        raise ApiError(400, "guided_choice must list at least one choice", param="guided_choice")
    grammar = parsed.guided_grammar or (guided and guided.grammar)
    schema = _schema_spec(json_value, "guided_json") if json_value is not None else None
    asked.append(("guided_json", schema))
    asked.append(("guided_regex", StructuredSpec("regex", regex) if regex else None))
    asked.append(
        ("guided_choice", StructuredSpec("choice", json.dumps(choice)) if choice else None)
    )
    asked.append(("guided_grammar", StructuredSpec("lark", grammar) if grammar else None))
    return asked


def _format_spec(fmt) -> StructuredSpec | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(
            400, "response_format json_schema needs json_schema.schema", "response_format"
        )
    return _schema_spec(fmt.json_schema.schema_, "response_format")


def _schema_spec(schema, param: str) -> StructuredSpec:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    if not text.strip():
        raise ApiError(400, f"{param} must hold a JSON schema, got an empty string", param)
    return StructuredSpec("json_schema", text)
