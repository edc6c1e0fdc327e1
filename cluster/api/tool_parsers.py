"""Tool calls in generated text: parsers by name, for whole outputs and for streams.

Called by the frontend for chat requests with `tool_choice: auto` (the model decides
whether to call): the parser named by `pdserve serve --tool-call-parser` splits the
output into plain content and calls. A stream feeds it text deltas as they come and
gets back the content safe to show now (text that might still become a call is held
back) and every call whose text is complete; `finish` flushes the rest.

`hermes`: each call is a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>`, the format of Hermes, Qwen2.5 and many fine-tunes.
A block whose JSON does not parse stays content, so no text is ever lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""


class HermesToolParser:
    """One per request; `feed` the text deltas in order, then `finish`."""

    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._pending = ""
        """Text not yet returned: a possible start of a call, or a call's body."""

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Content to stream now, and the calls completed by this delta."""
        self._pending += delta
        content, calls = [], []
        while True:
            start = self._pending.find(self.OPEN)
            if start < 0:
                keep = _possible_prefix(self._pending, self.OPEN)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            end = self._pending.find(self.CLOSE, start)
            content.append(self._pending[:start])
            if end < 0:
                self._pending = self._pending[start:]
                break
            body = self._pending[start + len(self.OPEN) : end]
            call = _parse_call(body)
            if call is None:
                content.append(self._pending[start : end + len(self.CLOSE)])
            else:
                calls.append(call)
            self._pending = self._pending[end + len(self.CLOSE) :]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end of the output: an unterminated call whose JSON is whole still
        counts (a stop string may have eaten the closing tag); anything else is content."""
        rest, self._pending = self._pending, ""
        if rest.startswith(self.OPEN):
            call = _parse_call(rest[len(self.OPEN) :])
            if call is not None:
                return "", [call]
        return rest, []

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """A whole output at once: (content, calls)."""
        content, calls = self.feed(text)
        tail, more = self.finish()
        return content + tail, calls + more


def _parse_call(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body.strip())
    except (json.JSONDecodeError, RecursionError):  # not a call: too deep to be one
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return ParsedToolCall(value["name"], arguments)
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _possible_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}
"""Parser name (`--tool-call-parser`) -> class; `none` turns parsing off."""


def make_tool_parser(name: str) -> HermesToolParser | None:
    if name == "none":
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {name!r}; known: none, {', '.join(TOOL_PARSERS)}"
        )
    return TOOL_PARSERS[name]()
