"""Tool calling for chat requests: what the model is shown, what it may say, and how
its answer becomes OpenAI `tool_calls`.

A request with `tools` goes through here twice. Before it is admitted: the tools are
rendered through the model's chat template (`tools=`; a template that ignores them
gets them in a system message instead, so the model always sees them), and
`tool_choice` picks the constraint:
    none      rendered, never parsed: the answer is content
    auto      rendered; the answer is parsed by the server's tool call parser
              (`--tool-call-parser`, cluster/api/tool_parsers.py)
    required  the answer is constrained (structured output) to a JSON array of
              {"name": one of the tools, "parameters": that tool's schema}
    named     the answer is constrained to the named function's parameter schema:
              the whole answer is that call's arguments.
After: `ToolCallReader` turns the answer (whole, or streamed) into content and calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from cluster.api.tool_parsers import ParsedToolCall, make_tool_parser
from engine.sampling_params import StructuredSpec

_PREAMBLE = (
    "# Tools\n\nYou can call the functions below. Their signatures, one JSON object per "
    "line:\n<tools>\n{tools}\n</tools>\n\nTo call one, answer with a JSON object holding "
    "its name and arguments between <tool_call> and </tool_call>, for example:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolChoice:
    """`mode` none | auto | required | named; `name` the function when named."""

    mode: str
    name: str | None = None
    parallel: bool = True
    """`parallel_tool_calls`: False limits a `required` answer to one call."""


def function_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_grammar(tools: list[dict], choice: ToolChoice) -> StructuredSpec | None:
    """The constraint on the answer: none for `none` and `auto`."""
    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return StructuredSpec("json_schema", json.dumps(function_schema(tool)))
    if choice.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [t["function"]["name"]]},
                "parameters": function_schema(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return StructuredSpec("json_schema", json.dumps(schema))


def with_tools_preamble(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For chat templates that do not render `tools`: the tool list in a system message."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    preamble = _PREAMBLE.format(tools=lines)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(call: ParsedToolCall, call_id: str | None = None) -> dict:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass
class ToolCallReader:
    """One per choice of a chat request with tools: reads the answer as it streams."""

    choice: ToolChoice
    parser_name: str = "hermes"
    calls: list[ParsedToolCall] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._parser = make_tool_parser(self.parser_name) if self.choice.mode == "auto" else None

    @property
    def constrained(self) -> bool:
        return self.choice.mode in ("required", "named")

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Content to show now, and calls completed by this delta."""
        if self.constrained:
            self._text.append(delta)
            return "", []
        if self._parser is None:
            return delta, []
        content, calls = self._parser.feed(delta)
        self.calls += calls
        return content, calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end: the rest of the content, and the calls not yet returned."""
        if self.choice.mode == "named":
            calls = [ParsedToolCall(self.choice.name, "".join(self._text))]
        elif self.choice.mode == "required":
            calls = _required_calls("".join(self._text))
        elif self._parser is not None:
            content, calls = self._parser.finish()
            self.calls += calls
            return content, calls
        else:
            return "", []
        self.calls += calls
        return "", calls

    def arguments_delta(self, delta: str) -> str:
        """Named choice, streaming: the answer is the arguments, shown as they come."""
        return delta if self.choice.mode == "named" else ""


def _required_calls(text: str) -> list[ParsedToolCall]:
    try:
        items = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return []
    if not isinstance(items, list):
        return []
    return [
        ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]
