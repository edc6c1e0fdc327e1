"""`/tokenize` and `/detokenize` as vLLM serves them: what a prompt or a chat becomes in
the served model's tokens, and back, so that clients can count tokens (for a budget, or
a benchmark's exact prompt lengths) without loading the tokenizer themselves.

Called by the frontend's routes. A chat renders through `chat_prompt_ids`, the same
function /v1/chat/completions prefills from, so its count is that request's
`usage.prompt_tokens`.
"""

from __future__ import annotations

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict

from cluster.api.openai_params import message_dict, template_options
from cluster.api.openai_protocol import ApiError, ChatMessage, ChatTemplateOptions, ToolDef
from cluster.api.tools import with_tools_preamble
from engine.tokenizer import Tokenizer


class TokenizeBody(ChatTemplateOptions):
    """Either `prompt` (text) or `messages` (a chat, with its `tools` and template options)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool = True
    """For `prompt`: the tokenizer's BOS and the like, as /v1/completions adds them."""
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None, options: dict
) -> list[int]:
    """A chat's prompt token ids: the template renders the tools where it reads them,
    else they go in a preamble message (cluster/api/tools.py). `options`: from
    `openai_params.template_options`. Messages the template refuses (its
    raise_exception, say "roles must alternate") are the client's mistake: a 400."""
    if tools and not tokenizer.template_renders_tools:
        messages, tools = with_tools_preamble(messages, tools), None
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, **options)
    except (TemplateError, ValueError) as exc:
        raise ApiError(
            400, f"the chat template cannot render these messages: {exc}", param="messages"
        ) from None


def tokenize(tokenizer: Tokenizer, body: TokenizeBody, max_model_len: int) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        messages = [message_dict(m) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        ids = chat_prompt_ids(tokenizer, messages, tools or None, template_options(body))
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    reply = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = [tokenizer.token_text(t) for t in ids]
    return reply


def detokenize(tokenizer: Tokenizer, body: DetokenizeBody) -> dict:
    check_token_ids(tokenizer, body.tokens, "tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def check_token_ids(tokenizer: Tokenizer, token_ids, param: str) -> None:
    """A 400 naming `param` where a token id lies outside the served vocabulary."""
    vocab = tokenizer.vocab_size
    outside = sorted({t for t in token_ids if not 0 <= t < vocab})
    if outside:
        raise ApiError(400, f"{param} holds token ids outside [0, {vocab}): {outside[:8]}", param)
