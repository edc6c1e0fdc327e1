"""OpenAI response shapes: one `ChoiceWriter` per choice turns its stream of
`GenerationChunk`s into OpenAI objects, streamed (`delta`) or whole (`final`).

What a choice carries besides its text, and where it comes from:
    logprobs      completions: {tokens, token_logprobs, top_logprobs, text_offset};
                  chat: {content: [{token, logprob, bytes, top_logprobs}]}; each
                  chunk carries the logprobs of its own tokens (engine/logprobs.py)
    echo          completions: the prompt's text leads the choice, and with logprobs
                  the prompt's tokens lead the lists (the first one's logprob null)
    tool_calls    chat with tools: `cluster.api.tools.ToolCallReader` splits the answer
                  into content and calls; finish_reason `tool_calls` when it made some
                  (auto, required), `stop`/`length` for a named function as vLLM does.
Usage and envelopes are plain functions at the bottom.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from cluster.api.openai_protocol import ParsedRequest
from cluster.api.tool_parsers import ParsedToolCall
from cluster.api.tools import ToolCallReader, new_call_id, openai_call
from cluster.flow.request import GenerationChunk
from engine.logprobs import TokenLogprobs
from engine.tokenizer import Tokenizer

_FLOOR = -9999.0
"""JSON has no -inf: a banned token's logprob is reported as this (vLLM does the same)."""


class TokenNames:
    """Token id -> its text, cached; one per frontend."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.token_text(token_id)
        return self._texts[token_id]


@dataclass
class EchoedPrompt:
    """Completions with `echo`: what leads the choice."""

    text: str
    token_ids: list[int]


@dataclass
class ChoiceWriter:
    """One choice of one request; `delta` and `final` are called by the frontend."""

    index: int
    parsed: ParsedRequest
    names: TokenNames
    echo: EchoedPrompt | None = None
    tools: ToolCallReader | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    """Chat: content entries; completions: per-token (token, logprob, top) triples."""
    text_offset: int = 0
    finish_reason: str | None = None
    num_output_tokens: int = 0
    timings: dict = field(default_factory=dict)
    _pending_logprobs: list = field(default_factory=list)
    _named_call_id: str | None = None
    _num_calls: int = 0
    _started: bool = False
    _role_sent: bool = False

    @property
    def chat(self) -> bool:
        return self.parsed.kind == "chat"

    # --- one chunk ------------------------------------------------------------------

    def _take(self, chunk: GenerationChunk) -> tuple[str, list]:
        """Record a chunk; returns its text and its logprob entries as OpenAI lists."""
        first, self._started = not self._started, True
        wants_logprobs = self.parsed.logprobs is not None
        text = "" if self.parsed.echo_only else chunk.text
        entries = []
        if first and self.echo is not None:
            text = self.echo.text + text
            if chunk.prompt_logprobs is not None and wants_logprobs:
                entries += self._completion_entries(self.echo.token_ids, chunk.prompt_logprobs)
        if chunk.logprobs is not None and wants_logprobs and not self.parsed.echo_only:
            if self.chat:
                entries += [self._chat_entry(e) for e in chunk.logprobs]
            else:
                ids = [e.token_id for e in chunk.logprobs]
                entries += self._completion_entries(ids, chunk.logprobs)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.timings = chunk.timings
            self.num_output_tokens = 0 if self.parsed.echo_only else chunk.num_output_tokens
        self.text.append(text)
        self.logprobs += entries
        return text, entries

    def delta(self, chunk: GenerationChunk) -> dict | None:
        """The streamed choice object for this chunk, or None when nothing can be shown
        yet (text held back); held-back logprobs ride with the next shown chunk."""
        text, entries = self._take(chunk)
        self._pending_logprobs += entries
        body = self._chat_delta(text, chunk.finished) if self.chat else {"text": text}
        if body is None or (not text and not body.get("tool_calls") and not chunk.finished):
            return None
        if self.chat and not self._role_sent:
            body = {"role": "assistant", **body}  # with the first shown delta, never before
            self._role_sent = True
        entries, self._pending_logprobs = self._pending_logprobs, []
        finish = self._finish_reason() if chunk.finished else None
        if self.chat:
            choice = {"index": self.index, "delta": body, "finish_reason": finish}
        else:
            choice = {"index": self.index, **body, "finish_reason": finish}
        choice["logprobs"] = self._logprobs_object(entries) if entries else None
        return choice

    def final(self) -> dict:
        """The whole choice of a non-streaming response (after every chunk was `add`ed)."""
        text = "".join(self.text)
        logprobs = (
            self._logprobs_object(self.logprobs) if self.parsed.logprobs is not None else None
        )
        if not self.chat:
            return {
                "index": self.index,
                "text": text,
                "finish_reason": self.finish_reason,
                "logprobs": logprobs,
            }
        message = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = self.tools.feed(text)
            rest, more = self.tools.finish()
            calls = calls + more
            message["content"] = (content + rest) or (None if calls else "")
            if calls:
                message["tool_calls"] = [openai_call(c) for c in calls]
        return {
            "index": self.index,
            "message": message,
            "finish_reason": self._finish_reason(),
            "logprobs": logprobs,
        }

    def add(self, chunk: GenerationChunk) -> None:
        self._take(chunk)

    # --- pieces -----------------------------------------------------------------------

    def _finish_reason(self) -> str | None:
        reader = self.tools
        if reader is not None and reader.calls and reader.choice.mode in ("auto", "required"):
            return "tool_calls"
        return self.finish_reason

    def _chat_delta(self, text: str, finished: bool) -> dict | None:
        if self.tools is None:
            return {"content": text}
        if self.tools.choice.mode == "named":
            return self._named_arguments(text) if text else ({} if finished else None)
        content, calls = self.tools.feed(text)
        if finished:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [self._call_delta(call) for call in calls]
        return delta if (content or calls or finished) else None

    def _named_arguments(self, text: str) -> dict:
        """Named tool choice, streaming: the answer is the call's arguments, as they come."""
        self.tools.calls = [ParsedToolCall(self.tools.choice.name, "".join(self.text))]
        if self._named_call_id is None:
            self._named_call_id = new_call_id()
            call = openai_call(ParsedToolCall(self.tools.choice.name, text), self._named_call_id)
            return {"tool_calls": [{"index": 0, **call}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def _call_delta(self, call: ParsedToolCall) -> dict:
        delta = {"index": self._num_calls, **openai_call(call)}
        self._num_calls += 1
        return delta

    def _chat_entry(self, entry: TokenLogprobs) -> dict:
        return {
            **self._named(entry.token_id, entry.logprob),
            "top_logprobs": [self._named(t, lp) for t, lp in entry.top],
        }

    def _named(self, token_id: int, logprob: float) -> dict:
        text = self.names.text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def _completion_entries(self, token_ids: list[int], entries: list) -> list[dict]:
        out = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.names.text(token_id)
            top = None
            if entry is not None:
                top = {self.names.text(t): _finite(lp) for t, lp in entry.top}
                top.setdefault(text, _finite(entry.logprob))
            logprob = None if entry is None else _finite(entry.logprob)
            out.append({"token": text, "logprob": logprob, "top": top, "offset": self.text_offset})
            self.text_offset += len(text)
        return out

    def _logprobs_object(self, entries: list[dict]) -> dict:
        if self.chat:
            return {"content": entries}
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries],
            "text_offset": [e["offset"] for e in entries],
        }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > _FLOOR else _FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from a prefix cache,
    or None to leave `prompt_tokens_details` out (the server does not disclose it)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def envelope(request_id: str, parsed: ParsedRequest, final: bool) -> dict:
    if parsed.kind == "chat":
        kind = "chat.completion" if final else "chat.completion.chunk"
    else:
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": parsed.model}
