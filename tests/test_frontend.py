"""A live `pdserve serve` on loopback, driven by the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from bench.server_process import ServerProcess
from tests.factories import hf_greedy

pytestmark = pytest.mark.slow

API_KEY = "test-key"
ALIAS = "house-model"
MAX_IN_FLIGHT = 16


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = [
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--transport",
        "shm",
        "--block-size",
        "8",
        "--decode-kv-blocks",
        "1200",
        "--max-model-len",
        "512",
        "--api-key",
        API_KEY,
        "--max-in-flight",
        str(MAX_IN_FLIGHT),
        "--served-model-name",
        tiny_llama_dir.name,
        ALIAS,
    ]
    process = ServerProcess(args)
    yield process
    leftovers = process.stop()
    assert process.proc.returncode == 0, process.output()
    assert not leftovers, f"processes left after SIGTERM: {[p.pid for p in leftovers]}"


@pytest.fixture(scope="module")
def model_id(tiny_llama_dir):
    return tiny_llama_dir.name


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def tokenizer(tiny_llama_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer(tiny_llama_dir)


def reference_text(tiny_llama_dir, tokenizer, prompt_ids, max_tokens):
    tokens = hf_greedy(tiny_llama_dir, prompt_ids, max_tokens)[0]
    return tokenizer.decode(tokens), tokens


def test_completion_non_streaming_equals_transformers(client, model_id, tiny_llama_dir, tokenizer):
    prompt = "The quick brown fox"
    expected, tokens = reference_text(tiny_llama_dir, tokenizer, tokenizer.encode(prompt), 12)

    response = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )

    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert response.usage.completion_tokens == len(tokens) == 12
    timings = response.model_extra["pdserve_timings"]
    assert timings["transport"] == "shm" and timings["kv_bytes"] > 0


def test_chat_streaming_equals_transformers_with_usage(client, model_id, tiny_llama_dir, tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Paged attention"}]}]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Paged attention"}])
    expected, _ = reference_text(tiny_llama_dir, tokenizer, prompt_ids, 10)

    stream = client.chat.completions.create(
        model=model_id,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)

    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.content, "first chunk must carry the first token"
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == expected
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_non_streaming_and_completion_streaming(client, model_id, tiny_llama_dir, tokenizer):
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "decode"}])
    expected, _ = reference_text(tiny_llama_dir, tokenizer, prompt_ids, 8)
    chat = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "decode"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == expected

    prompt = "Prefill builds the cache"
    expected, _ = reference_text(tiny_llama_dir, tokenizer, tokenizer.encode(prompt), 8)
    stream = client.completions.create(
        model=model_id,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream) == expected


def test_16_concurrent_streams_equal_transformers(server, model_id, tiny_llama_dir, tokenizer):
    prompts = [f"request number {i} " + "word " * (i % 7) for i in range(16)]
    expected = [
        reference_text(tiny_llama_dir, tokenizer, tokenizer.encode(p), 10)[0] for p in prompts
    ]

    async def one(client, prompt):
        stream = await client.completions.create(
            model=model_id,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == expected


def kv_blocks_used(server) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve_kv_blocks_used{")
    )


def wait_for_idle_pools(server, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while kv_blocks_used(server) != 0:
        assert time.monotonic() < deadline, "KV blocks still in use after the requests ended"
        time.sleep(0.2)


def test_client_disconnect_aborts_and_frees_blocks(server, client, model_id):
    with requests.post(
        f"{server.url}/v1/completions",
        stream=True,
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": model_id,
            "prompt": "long story",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        },
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith(b"data: {") for line in received)

    wait_for_idle_pools(server)
    metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    assert 'pdserve_requests_total{endpoint="completions",outcome="cancelled"} 1.0' in metrics
    after = client.completions.create(model=model_id, prompt="next", max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason in ("length", "stop")


def post(server, path, body, headers=None, raw=None):
    headers = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}
    if raw is not None:
        return requests.post(f"{server.url}{path}", data=raw, headers=headers, timeout=30)
    return requests.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def get(server, path):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return requests.get(f"{server.url}{path}", headers=headers, timeout=10)


BAD_INPUTS = [
    ("malformed json", "/v1/completions", None, b"{not json", 400),
    (
        "wrong type",
        "/v1/completions",
        {"model": "M", "prompt": "x", "max_tokens": "many"},
        None,
        400,
    ),
    (
        "max_tokens zero",
        "/v1/completions",
        {"model": "M", "prompt": "x", "max_tokens": 0},
        None,
        400,
    ),
    (
        "max_tokens absurd",
        "/v1/completions",
        {"model": "M", "prompt": "x", "max_tokens": 10**12},
        None,
        400,
    ),
    (
        "prompt too long",
        "/v1/completions",
        {"model": "M", "prompt": "word " * 700, "max_tokens": 4},
        None,
        400,
    ),
    ("empty messages", "/v1/chat/completions", {"model": "M", "messages": []}, None, 400),
    ("empty prompt", "/v1/completions", {"model": "M", "prompt": ""}, None, 400),
    (
        "logprobs over 20",
        "/v1/completions",
        {"model": "M", "prompt": "x", "logprobs": 21},
        None,
        400,
    ),
    ("n=0", "/v1/completions", {"model": "M", "prompt": "x", "n": 0}, None, 400),
    ("best_of", "/v1/completions", {"model": "M", "prompt": "x", "best_of": 2}, None, 400),
    (
        "audio",
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "audio": {"voice": "a"}},
        None,
        400,
    ),
    (
        "bad role",
        "/v1/chat/completions",
        {"model": "M", "messages": [{"role": "wizard", "content": "x"}]},
        None,
        400,
    ),
    (
        "logit_bias past the vocabulary",
        "/v1/completions",
        {"model": "M", "prompt": "x", "logit_bias": {"99999999": 5}},
        None,
        400,
    ),
    (
        "stop_token_ids past the vocabulary",
        "/v1/completions",
        {"model": "M", "prompt": "x", "stop_token_ids": [-3]},
        None,
        400,
    ),
    (
        "empty guided_choice",
        "/v1/completions",
        {"model": "M", "prompt": "x", "guided_choice": []},
        None,
        400,
    ),
    (
        "continue the final message and open a new one",
        "/v1/chat/completions",
        {
            "model": "M",
            "messages": [{"role": "assistant", "content": "x"}],
            "continue_final_message": True,
        },
        None,
        400,
    ),
    ("tokenize neither", "/tokenize", {"model": "M"}, None, 400),
    (
        "tokenize both",
        "/tokenize",
        {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        None,
        400,
    ),
    ("detokenize past the vocabulary", "/detokenize", {"tokens": [5, -1]}, None, 400),
    ("detokenize text", "/detokenize", {"tokens": "abc"}, None, 400),
    ("tokenize for another model", "/tokenize", {"model": "gpt-17", "prompt": "x"}, None, 404),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "x"}, None, 404),
    ("body too large", "/v1/completions", None, b'{"prompt": "' + b"x" * (5 << 20) + b'"}', 413),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, client, model_id, case):
    _, path, body, raw, status = case
    if body is not None and body.get("model") == "M":
        body = {**body, "model": model_id}

    response = post(server, path, body, raw=raw)

    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if case[0] == "prompt too long":
        assert "512" in error["message"]
    # Greedy and past EOS: a sampled answer may end at EOS after one token.
    good = client.completions.create(
        model=model_id,
        prompt="still alive",
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert good.usage.completion_tokens == 2


def test_a_busy_port_fails_before_ray_starts_and_says_so(server, tiny_llama_dir, model_id):
    """The fixture's server bound port 0 and announced the port it got; a second server
    asked for that port stops at once with the address and the reason, and the first
    keeps serving."""
    command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(server.port)]
    command += ["--model", str(tiny_llama_dir), "--dtype", "float32"]
    second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert second.returncode != 0
    assert f"cannot listen on 127.0.0.1:{server.port}: Address already in use" in second.stderr
    assert "Ray" not in second.stdout + second.stderr
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200


def test_missing_api_key_is_401(server, model_id):
    response = requests.post(
        f"{server.url}/v1/completions", json={"model": model_id, "prompt": "x"}, timeout=10
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_models_and_health(server, client, model_id):
    assert [m.id for m in client.models.list()] == [model_id]
    health = requests.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 200
    assert health.json()["workers"] == {"prefill": 1, "decode": 1, "colocated": 0}


def test_any_served_name_or_none_picks_the_model_and_others_get_404(
    server, client, model_id, tiny_llama_dir
):
    """`--served-model-name` as vLLM takes it: every name it lists is accepted and echoed,
    the first is the one listed, a request without `model` gets that one, and the model's
    path (accepted when no names are given) is not."""
    assert [m.id for m in client.models.list()] == [model_id]
    answers = {}
    for name in (model_id, ALIAS, None):
        body = {"prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}
        response = post(server, "/v1/completions", {**body, **({"model": name} if name else {})})
        assert response.status_code == 200, response.text
        answers[name] = response.json()
    assert [answers[name]["model"] for name in answers] == [model_id, ALIAS, model_id]
    texts = {a["choices"][0]["text"] for a in answers.values()}
    assert len(texts) == 1
    by_path = post(server, "/v1/completions", {"model": str(tiny_llama_dir), "prompt": "x"})
    assert by_path.status_code == 404, by_path.text
    assert model_id in by_path.json()["error"]["message"]


def test_a_long_prompt_without_max_tokens_fills_the_context_left(server, model_id, tokenizer):
    """No max_tokens: 256 where the prompt leaves room, else the room left (as vLLM). Sent,
    it is taken as sent: a prompt plus max_tokens past the context is refused."""
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)[:500]
    body = {"model": model_id, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    filled = post(server, "/v1/completions", body)
    assert filled.status_code == 200, filled.text
    usage = filled.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (500, 12)
    for refused in ({"max_tokens": 13}, {"min_tokens": 13}):
        response = post(server, "/v1/completions", {**body, **refused})
        assert response.status_code == 400, (refused, response.text)
        assert "512" in response.json()["error"]["message"]


def test_a_model_and_the_version_are_served_on_their_own(server, model_id):
    listed = get(server, "/v1/models").json()["data"][0]
    assert get(server, f"/v1/models/{model_id}").json() == listed
    missing = get(server, "/v1/models/gpt-17")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "model_not_found"
    from cluster import package_version
    from cluster.cli.main import build_parser

    assert get(server, "/version").json() == {"version": package_version()}
    with pytest.raises(SystemExit) as printed:
        build_parser().parse_args(["--version"])
    assert printed.value.code == 0


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tokenize_counts_what_a_request_prefills_and_detokenize_reverses_it(
    server, client, model_id, tokenizer
):
    text = "The quick brown fox"
    tokenized = post(server, "/tokenize", {"model": model_id, "prompt": text}).json()
    assert tokenized["tokens"] == tokenizer.encode(text)
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 512
    completion = client.completions.create(model=model_id, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == tokenized["count"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    counts = []
    for tools in (None, [TOOL]):
        body = {"messages": messages, **({"tools": tools} if tools else {})}
        counts.append(post(server, "/tokenize", body).json()["count"])
        chat = client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=1, **({"tools": tools} if tools else {})
        )
        assert chat.usage.prompt_tokens == counts[-1], tools
    assert counts[1] > counts[0]  # the tools are in the rendered prompt
    closed = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert (
        closed.json()["count"] < post(server, "/tokenize", {"messages": messages}).json()["count"]
    )

    started = [*messages, {"role": "assistant", "content": "The answer is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    opened = post(server, "/tokenize", {"messages": started, **options}).json()
    assert opened["tokens"] == tokenizer.apply_chat_template(started, **options)
    assert tokenizer.decode(opened["tokens"]).endswith("The answer is")
    chat = client.chat.completions.create(
        model=model_id, messages=started, max_tokens=1, extra_body=options
    )
    assert chat.usage.prompt_tokens == opened["count"]

    strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == [tokenizer.token_text(t) for t in tokenized["tokens"]]
    back = post(server, "/detokenize", {"model": model_id, "tokens": tokenized["tokens"]})
    assert back.json()["prompt"] == tokenizer.decode(tokenized["tokens"], skip_special_tokens=False)
    assert text in back.json()["prompt"]


def test_overload_gets_429_with_retry_after_then_recovers(server, client, model_id):
    """More concurrent long streams than admission slots: the excess gets 429, none hang."""
    body = {
        "model": model_id,
        "prompt": "hold",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    excess = 24
    # All posts leave together: on a fast machine a 480-token stream of the tiny model
    # ends in about a second, so staggered posts could all fit in the slots.
    start_line = threading.Barrier(MAX_IN_FLIGHT + excess)

    def open_stream(_):
        start_line.wait(timeout=30)
        response = requests.post(
            f"{server.url}/v1/completions", json=body, headers=headers, stream=True, timeout=60
        )
        if response.status_code == 200:
            next(response.iter_lines())
        return response

    with ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT + excess) as pool:
        responses = list(pool.map(open_stream, range(MAX_IN_FLIGHT + excess)))
    for response in responses:
        response.close()

    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429} and statuses.count(200) >= MAX_IN_FLIGHT // 2, statuses
    assert all(r.headers["Retry-After"] == "1" for r in responses if r.status_code == 429)
    wait_for_idle_pools(server)
    after = client.completions.create(
        model=model_id, prompt="after", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert after.usage.completion_tokens == 2


def test_sse_wire_format_ends_with_done(server, model_id):
    response = requests.post(
        f"{server.url}/v1/chat/completions",
        timeout=30,
        stream=True,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": model_id,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        },
    )
    events = [line for line in response.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    final = json.loads(events[-2].removeprefix(b"data: "))
    assert "pdserve_timings" in final and final["pdserve_timings"]["ttft_s"] is not None


def test_a_stop_signal_lets_requests_finish_then_ends_the_rest_with_503(tiny_llama_dir):
    """SIGTERM: new connections are refused at once; a stream that ends within the
    drain ends as usual; a stream and a non-streaming request that would run past it
    get a 503 'shutting down' (an error event then [DONE]; an error answer) when it
    runs out; the server then exits cleanly."""
    drain_s = 4.0
    server = ServerProcess(
        ["--model", str(tiny_llama_dir), "--dtype", "float32", "--mode", "colocated",
         "--block-size", "8", "--drain-timeout-s", str(drain_s)],
        env={"PDSERVE_STEP_DELAY_S": "0.05"},
    )  # fmt: skip
    model = tiny_llama_dir.name
    first_chunks = {"short": threading.Event(), "long": threading.Event()}
    ended_at: dict[str, float] = {}

    def stream(name: str, max_tokens: int) -> list[str]:
        body = {"model": model, "prompt": f"{name} story", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        lines = []
        with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line.decode()[len("data: ") :])
                    first_chunks[name].set()
        ended_at[name] = time.monotonic()
        return lines

    def collect() -> requests.Response:
        body = {"model": model, "prompt": "a long one", "max_tokens": 400, "ignore_eos": True}
        return requests.post(f"{server.url}/v1/completions", json=body, timeout=60)

    try:
        with ThreadPoolExecutor(3) as pool:
            long_stream, answer = pool.submit(stream, "long", 400), pool.submit(collect)
            short_stream = pool.submit(stream, "short", 24)
            assert all(event.wait(30) for event in first_chunks.values())
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            with pytest.raises(requests.ConnectionError):
                for _ in range(100):  # the listener closes within a moment
                    requests.get(f"{server.url}/health", timeout=2)
                    time.sleep(0.1)
            short, long, answer = short_stream.result(), long_stream.result(), answer.result()
        assert server.proc.wait(timeout=60) == 0, server.output()
    finally:
        leftovers = server.stop()
    assert not leftovers

    assert short[-1] == "[DONE]" and ended_at["short"] < signalled + drain_s
    finished = json.loads(short[-2])
    assert finished["choices"][0]["finish_reason"] == "length" and "error" not in finished

    assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["code"] == 503
    assert "shutting down" in json.loads(long[-2])["error"]["message"]
    assert drain_s - 0.5 < ended_at["long"] - signalled < drain_s + 3
    assert all(json.loads(line)["choices"][0]["finish_reason"] is None for line in long[:-2])

    assert answer.status_code == 503 and answer.json()["error"]["code"] == 503
