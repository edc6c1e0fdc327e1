"""OpenAI bodies -> what the cluster runs, and tool-call text -> OpenAI tool calls
(no server: parsing and shaping only)."""

from __future__ import annotations

import json

import pytest

from cluster.api.openai_protocol import ApiError, parse_body
from cluster.api.tool_parsers import HermesToolParser, ParsedToolCall
from cluster.api.tools import ToolCallReader, ToolChoice, tool_grammar, with_tools_preamble

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hi", **fields}


def test_sampling_fields_reach_the_params():
    parsed = parse_body(
        "completion",
        completion(
            prompt=["a", "b"],
            n=3,
            seed=5,
            logprobs=2,
            echo=True,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            min_tokens=2,
            logit_bias={"7": 150, "9": -3},
            stop_token_ids=[4],
            cache_salt="tenant-a",
            skip_special_tokens=False,
            min_p=0.05,
        ),
    )
    p = parsed.params
    assert parsed.prompts == ["a", "b"] and parsed.n == 3 and parsed.num_choices == 6
    assert (p.logprobs, p.prompt_logprobs, parsed.echo, parsed.echo_only) == (2, 2, True, False)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == ((7, 100.0), (9, -3.0)) and p.stop_token_ids == (4,)
    assert not p.skip_special_tokens and parse_body("chat", chat()).params.skip_special_tokens
    assert p.min_p == 0.05
    assert p.min_tokens == 2 and p.cache_salt == "tenant-a"
    scoring = parse_body("completion", completion(echo=True, logprobs=0, max_tokens=0))
    assert scoring.echo_only and scoring.params.max_tokens == 1


def test_chat_logprobs_and_structured_outputs():
    parsed = parse_body("chat", chat(logprobs=True, top_logprobs=3))
    assert parsed.params.logprobs == 3 and parsed.params.prompt_logprobs is None
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert parse_body("chat", chat(response_format=fmt)).params.structured.kind == "json_schema"
    assert parse_body("chat", chat(guided_regex="a+")).params.structured.kind == "regex"
    assert parse_body("chat", chat(guided_choice=["a", "b"])).params.structured.kind == "choice"
    spec = parse_body(
        "chat", chat(structured_outputs={"json": {"type": "object"}})
    ).params.structured
    assert spec.kind == "json_schema"
    named = {"type": "function", "function": {"name": "get_weather"}}
    parsed = parse_body("chat", chat(tools=TOOLS, tool_choice=named))
    assert parsed.tool_choice == ToolChoice("named", "get_weather")
    assert json.loads(parsed.params.structured.value)["required"] == ["city"]
    assert parse_body("chat", chat(tools=TOOLS)).tool_choice == ToolChoice("auto")


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("completion", completion(best_of=2), "best_of"),
        ("chat", chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
        ("chat", chat(top_logprobs=2), "top_logprobs"),
        ("completion", completion(logprobs=21), "logprobs"),
        ("completion", completion(n=0), "n"),
        ("completion", completion(n=65), "n"),
        ("completion", completion(max_tokens=0), "max_tokens"),
        ("chat", chat(guided_regex="(open"), "guided_regex"),
        ("chat", chat(guided_json={"type": "object"}, guided_regex="a"), "guided_regex"),
        ("chat", chat(guided_json=""), "guided_json"),  # found by the API fuzzer: was a 500
        ("chat", chat(tool_choice="required"), "tool_choice"),
        (
            "chat",
            chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}),
            "tool_choice",
        ),
        ("completion", completion(logit_bias={"a": 1}), "logit_bias"),
        ("completion", completion(presence_penalty=3), None),
        ("completion", completion(cache_salt=""), "cache_salt"),
        ("chat", chat(cache_salt="x" * 1025), "cache_salt"),
        ("chat", chat(cache_salt=7), "cache_salt"),
        ("chat", chat(continue_final_message=True), "continue_final_message"),
        ("chat", chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
        ("chat", chat(chat_template="{{ messages }}"), "chat_template"),
        ("completion", completion(use_beam_search=True), "use_beam_search"),
        ("completion", completion(bad_words=["x"]), "bad_words"),
        ("chat", chat(allowed_token_ids=[1, 2]), "allowed_token_ids"),
        ("completion", completion(prompt_logprobs=2), "prompt_logprobs"),
        ("completion", completion(truncate_prompt_tokens=5), "truncate_prompt_tokens"),
        ("completion", completion(min_p=-0.1), "min_p"),
    ],
)
def test_refused_bodies_get_a_400_naming_the_parameter(kind, body, param):
    with pytest.raises(ApiError) as caught:
        parse_body(kind, body)
    assert caught.value.status == 400
    if param is not None:
        assert caught.value.param == param, caught.value.message


def test_chat_template_options_reach_the_template():
    parsed = parse_body(
        "chat",
        chat(
            add_generation_prompt=False,
            continue_final_message=True,
            chat_template_kwargs={"enable_thinking": False},
        ),
    )
    assert parsed.template_options == {
        "enable_thinking": False,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    defaults = parse_body("chat", chat()).template_options
    assert defaults == {"add_generation_prompt": True, "continue_final_message": False}


def test_messages_the_chat_template_refuses_are_a_400(tiny_llama_dir):
    """A template's raise_exception (Llama 2's and Mistral's "roles must alternate") or a
    final message transformers cannot leave open is the client's mistake, not a 500."""
    from cluster.api.tokenize_api import chat_prompt_ids
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llama_dir)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    tokenizer.hf.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    continuing = {"add_generation_prompt": False, "continue_final_message": True}
    with pytest.raises(ApiError) as caught:  # "Hello" is not in "HIHELLO": nowhere to go on
        chat_prompt_ids(tokenizer, chat, None, continuing)
    assert caught.value.status == 400 and caught.value.param == "messages"
    tokenizer.hf.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(ApiError) as caught:
        chat_prompt_ids(tokenizer, chat, None, {})
    assert caught.value.status == 400 and "roles must alternate" in caught.value.message


def test_best_of_one_is_accepted():
    assert parse_body("completion", completion(best_of=1)).n == 1


def test_required_tool_choice_is_an_array_of_named_calls():
    schema = json.loads(tool_grammar(TOOLS, ToolChoice("required")).value)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    reader = ToolCallReader(ToolChoice("required"))
    reader.feed('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", ')
    reader.feed('"parameters": {"city": "Oslo"}}]')
    assert reader.finish() == (
        "",
        [ParsedToolCall("get_time", "{}"), ParsedToolCall("get_weather", '{"city": "Oslo"}')],
    )


def test_hermes_parser_whole_and_streamed_in_any_pieces():
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call> and <tool_call>{"name": "get_time", "arguments": {}}</tool_call> done'
    )
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me check.  and  done"
    assert calls == [
        ParsedToolCall("get_weather", '{"city": "Oslo"}'),
        ParsedToolCall("get_time", "{}"),
    ]
    for size in (1, 3, 7):
        parser, streamed, streamed_calls = HermesToolParser(), "", []
        for start in range(0, len(text), size):
            piece, new = parser.feed(text[start : start + size])
            assert "<tool" not in piece
            streamed, streamed_calls = streamed + piece, streamed_calls + new
        rest, more = parser.finish()
        assert (streamed + rest, streamed_calls + more) == (content, calls)


def test_hermes_keeps_what_is_not_a_call_as_content():
    text = "a <tool_call>not json</tool_call> b <tool_ca"
    assert HermesToolParser().parse(text) == (text, [])


def test_tools_preamble_for_templates_that_ignore_tools():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    framed = with_tools_preamble(messages, TOOLS)
    assert framed[0]["content"].startswith("Be brief.") and "get_weather" in framed[0]["content"]
    assert with_tools_preamble(messages[1:], TOOLS)[0]["role"] == "system"
