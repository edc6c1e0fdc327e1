"""The OpenAI API at vLLM's level, through the official openai SDK against a live
disaggregated `pdserve serve`: logprobs, echo, n, batched prompts, penalties,
structured output (incl. `chat.completions.parse`), tool calls, streaming included."""

from __future__ import annotations

import json
import shutil
import time

import jsonschema
import openai
import pytest
import requests
import torch
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from bench.server_process import ServerProcess
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.factories import CHAT_TEMPLATE, _hf_model, make_engine

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
TOOLS_TEMPLATE = (
    "{% if tools %}<s>tools\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}"
    "</s>\n{% endif %}" + CHAT_TEMPLATE
)
"""A chat template that renders the tool list (compactly: the tiny model's context is short)."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a chat template that renders tools."""
    directory = tmp_path_factory.mktemp("tools-model") / "tiny-tools"
    shutil.copytree(tiny_llama_dir, directory)
    tokenizer = Tokenizer(directory).hf
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    args = [
        "--model", str(model_dir), "--dtype", "float32", "--transport", "shm",
        "--block-size", "8", "--decode-kv-blocks", "1200", "--max-model-len", "512",
        "--health-interval-s", "0.2", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    process = ServerProcess(args)
    yield process
    leftovers = process.stop()
    assert not leftovers, f"processes left after SIGTERM: {[p.pid for p in leftovers]}"


@pytest.fixture(scope="module")
def model_id(model_dir):
    return model_dir.name


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def log_softmax_rows(model_dir, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# --- logprobs and echo --------------------------------------------------------------------


def test_completion_logprobs_with_echo_equal_transformers(client, model_id, model_dir, tokenizer):
    prompt = "The quick brown fox jumps"
    prompt_ids = tokenizer.encode(prompt)
    response = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=6, logprobs=3, echo=True, **GREEDY
    )
    choice = response.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(prompt_ids) + 6 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # echoed tokens are the prompt's; the output tokens follow
    output_ids = [
        t for t in tokenizer.hf.encode(choice.text[len(prompt) :], add_special_tokens=False)
    ]
    assert "".join(lp.tokens[len(prompt_ids) :]) == tokenizer.decode(output_ids)
    reference = log_softmax_rows(model_dir, prompt_ids + hf_greedy_ids(model_dir, prompt_ids, 6))
    ids = prompt_ids + hf_greedy_ids(model_dir, prompt_ids, 6)
    for position in range(1, len(ids)):
        assert (
            abs(lp.token_logprobs[position] - reference[position - 1, ids[position]].item())
            < TOLERANCE
        )
        # the top 3, plus the token when not among them (tokens whose text is the same,
        # such as lone UTF-8 bytes shown as U+FFFD, share one key)
        assert 1 <= len(lp.top_logprobs[position]) <= 4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    stream = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=6, logprobs=3, echo=True, stream=True, **GREEDY
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def hf_greedy_ids(model_dir, prompt_ids, count):
    from tests.factories import hf_greedy

    return hf_greedy(model_dir, prompt_ids, count)[0]


def test_echo_with_zero_max_tokens_scores_the_prompt(client, model_id, model_dir, tokenizer):
    """What lm-eval's loglikelihood asks: the prompt back, with its logprobs, nothing more."""
    prompt = "Paged attention stores keys"
    ids = tokenizer.encode(prompt)
    response = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=0, logprobs=1, echo=True, temperature=0
    )
    choice = response.choices[0]
    assert choice.text == prompt and response.usage.completion_tokens == 0
    reference = log_softmax_rows(model_dir, ids)
    total = sum(choice.logprobs.token_logprobs[1:])
    assert abs(total - sum(reference[p - 1, ids[p]].item() for p in range(1, len(ids)))) < 1e-3


def test_chat_logprobs_equal_transformers_streaming_and_not(client, model_id, model_dir, tokenizer):
    messages = [{"role": "user", "content": "Prefill builds the cache"}]
    prompt_ids = tokenizer.apply_chat_template(messages)
    output_ids = hf_greedy_ids(model_dir, prompt_ids, 5)
    reference = log_softmax_rows(model_dir, prompt_ids + output_ids)
    response = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for step, entry in enumerate(content):
        row = reference[len(prompt_ids) - 1 + step]
        assert abs(entry.logprob - row[output_ids[step]].item()) < TOLERANCE
        assert entry.token == tokenizer.token_text(output_ids[step])
        assert bytes(entry.bytes).decode("utf-8") == entry.token
        assert [t.token for t in entry.top_logprobs] == [
            tokenizer.token_text(i) for i in row.topk(2).indices.tolist()
        ]
    stream = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2,
        stream=True, **GREEDY,
    )  # fmt: skip
    streamed = [
        e.logprob
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == [e.logprob for e in content]


# --- n and batched prompts --------------------------------------------------------------


def metric(server, name: str, role: str) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{name}{{") and f'role="{role}"' in line
    )


def settled(server, name: str, role: str, timeout_s: float = 10.0) -> float:
    """The counter once two reads 0.5 s apart agree (health reports carry it)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        value = metric(server, name, role)
        if value == last:
            return value
        last = value
        time.sleep(0.5)
    return last


def test_n3_seeded_choices_equal_single_requests_and_the_prompt_is_prefilled_once(
    server, client, model_id
):
    prompt = [(7 * i) % 300 + 3 for i in range(43)]  # 5 full blocks of 8, and 3 tokens
    sampled = {"temperature": 1.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    hits_before = settled(server, "pdserve_prefix_cache_hit_tokens_total", "prefill")
    moved_before = metric(server, "pdserve_kv_transfer_bytes_total", "")

    response = client.completions.create(model=model_id, prompt=prompt, n=3, seed=100, **sampled)

    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    assert response.usage.prompt_tokens == 43 and response.usage.completion_tokens == 24
    hits = settled(server, "pdserve_prefix_cache_hit_tokens_total", "prefill") - hits_before
    assert hits == 2 * 40, "the two siblings must find the leader's 5 full blocks cached"
    timings = response.model_extra["pdserve_choice_timings"]
    assert [t["cached_tokens"] for t in timings] == [0, 40, 40]
    block_bytes = timings[1]["kv_bytes"]
    assert timings[0]["kv_bytes"] == 6 * block_bytes and timings[2]["kv_bytes"] == block_bytes
    for index, text in enumerate(texts):  # choice i is the single request with seed + i
        single = client.completions.create(
            model=model_id, prompt=prompt, seed=100 + index, **sampled
        )
        assert single.choices[0].text == text
    assert moved_before >= 0


def test_batched_prompts_equal_the_same_prompts_one_by_one(client, model_id):
    prompts = ["The quick brown fox", "Prefill builds", "def main():"]
    batched = client.completions.create(model=model_id, prompt=prompts, max_tokens=6, **GREEDY)
    singles = [
        client.completions.create(model=model_id, prompt=p, max_tokens=6, **GREEDY) for p in prompts
    ]
    assert [c.index for c in batched.choices] == [0, 1, 2]
    assert [c.text for c in batched.choices] == [s.choices[0].text for s in singles]
    assert batched.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batched.usage.completion_tokens == 18

    token_prompts = [[5, 6, 7, 8], [40, 41, 42]]
    stream = client.completions.create(
        model=model_id, prompt=token_prompts, max_tokens=4, stream=True, **GREEDY
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    one_by_one = [
        client.completions.create(model=model_id, prompt=p, max_tokens=4, **GREEDY).choices[0].text
        for p in token_prompts
    ]
    assert [texts[0], texts[1]] == one_by_one


# --- penalties -----------------------------------------------------------------------


def test_penalties_min_tokens_logit_bias_and_stop_ids_equal_the_engine(client, model_id, model_dir):
    prompt = [9, 30, 31, 9, 30, 77, 9]
    knobs = dict(
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        min_tokens=3,
        logit_bias={"42": 2.5, "9": -100},
        stop_token_ids=[77],
    )
    response = client.completions.create(
        model=model_id,
        prompt=prompt,
        max_tokens=16,
        temperature=0.8,
        seed=7,
        presence_penalty=knobs["presence_penalty"],
        frequency_penalty=knobs["frequency_penalty"],
        logit_bias=knobs["logit_bias"],
        extra_body={k: knobs[k] for k in ("repetition_penalty", "min_tokens", "stop_token_ids")},
    )
    params = SamplingParams(
        max_tokens=16,
        temperature=0.8,
        seed=7,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        min_tokens=3,
        logit_bias=((42, 2.5), (9, -100.0)),
        stop_token_ids=(77,),
    )
    expected = make_engine(model_dir).generate([prompt], params)[0]
    assert response.choices[0].text == expected.output_text
    assert response.usage.completion_tokens == len(expected.output_token_ids)


# --- structured output and tools ----------------------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    pet: str = Field(pattern="^(cat|dog)$")


def test_parse_with_a_pydantic_model_and_20_seeded_json_schema_samples(client, model_id):
    messages = [{"role": "user", "content": "Describe a person"}]
    parsed = client.chat.completions.parse(
        model=model_id, messages=messages, response_format=Person, max_tokens=80, seed=1
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person), parsed.choices[0].message.content

    fmt = type_to_response_format_param(Person)  # what `parse` sent: the strict schema
    schema = fmt["json_schema"]["schema"]
    assert schema["additionalProperties"] is False
    response = client.chat.completions.create(
        model=model_id, messages=messages, response_format=fmt, max_tokens=80, n=20, seed=1000
    )
    assert len(response.choices) == 20
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert len({c.message.content for c in response.choices}) > 10


def test_vllm_guided_extensions(client, model_id):
    messages = [{"role": "user", "content": "pick"}]
    choice = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=20, seed=3,
        extra_body={"guided_choice": ["alpha", "beta", "gamma"]},
    )  # fmt: skip
    assert choice.choices[0].message.content in ("alpha", "beta", "gamma")
    regex = client.completions.create(
        model=model_id, prompt="code:", max_tokens=20, seed=3,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{4}"},
    )  # fmt: skip
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    obj = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=60, seed=5,
        extra_body={"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                    "required": ["ok"], "additionalProperties": False}},
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].message.content)["ok"], bool)
    lark = client.completions.create(
        model=model_id, prompt="answer:", max_tokens=20, seed=3,
        extra_body={"guided_grammar": 'start: ("yes" | "no") "!"'},
    )  # fmt: skip
    assert lark.choices[0].text in ("yes!", "no!")
    stream = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=200, seed=8, stream=True,
        response_format={"type": "json_object"},
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert text.startswith("{")
    if chunks[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_named_and_required_tool_choice_return_arguments_that_validate(client, model_id, tokenizer):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    schema = WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=model_id, messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=40, seed=2
    )
    message = response.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # the tools went through the chat template
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert (
        response.usage.prompt_tokens == len(rendered) > len(tokenizer.apply_chat_template(messages))
    )

    stream = client.chat.completions.create(
        model=model_id, messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=40,
        seed=2, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices]
    pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments

    required = client.chat.completions.create(
        model=model_id, messages=messages, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, seed=4,
    )  # fmt: skip
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema)


HERMES_CALL = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
    r"</tool_call>"
)


def test_auto_tool_choice_parses_hermes_calls_streaming_and_not(client, model_id):
    """The tiny model never calls a tool on its own; a regex makes it write one, and
    the hermes parser (the server's default) must find it."""
    messages = [{"role": "user", "content": "Weather?"}]
    extra = {"guided_regex": r"Sure\. " + HERMES_CALL}
    response = client.chat.completions.create(
        model=model_id, messages=messages, tools=[WEATHER], max_tokens=150, seed=1, extra_body=extra
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    stream = client.chat.completions.create(
        model=model_id, messages=messages, tools=[WEATHER], max_tokens=150, seed=1,
        extra_body=extra, stream=True,
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "Sure. "
    calls = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert chunks[-1].finish_reason == "tool_calls"

    none = client.chat.completions.create(
        model=model_id, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=150,
        seed=1, extra_body=extra,
    )  # fmt: skip
    assert none.choices[0].message.tool_calls is None
    assert "<tool_call>" in none.choices[0].message.content


# --- what stays refused ---------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "x", "best_of": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "a"}},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "guided_regex": "("},
        ),
    ],
)
def test_refused_parameters_get_clear_400s_and_models_stays_honest(
    server, client, model_id, path, body
):
    response = requests.post(f"{server.url}{path}", json={"model": model_id, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("best_of", "audio", "guided_regex")
    assert [m.id for m in client.models.list()] == [model_id]
