"""A hostile client against a live `pdserve serve`: clients that vanish in every phase
of a request, bodies that used to crash a handler, and a burst of abandoned requests.
After each, no worker holds a block, lease or sequence for what was abandoned.

The server runs with a per-step delay (`PDSERVE_STEP_DELAY_S`), a 16-token step budget
and a capped KV link, so each phase lasts long enough to be seen in `/admin/workers`
and struck there; requests carry an `X-Request-Id` tag to be found by.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

FREED_WITHIN_S = 1.0
"""An abandoned request's blocks and lease are back this soon (the lease lasts 30 s)."""
BANDWIDTH = 200_000
"""KV link cap in bytes/s: a 240-token prompt of the tiny model (276 KB) takes ~1.4 s."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = [
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--transport", "shm",
        "--block-size", "8", "--max-model-len", "256", "--prefill-kv-blocks", "64",
        "--decode-kv-blocks", "32", "--max-batch-tokens", "16", "--prefill-chunk-size", "16",
        "--transport-lease-ttl-s", "30",
        "--transport-bandwidth-bytes-per-s", str(BANDWIDTH),
    ]  # fmt: skip
    process = ServerProcess(args, env={"PDSERVE_STEP_DELAY_S": "0.05"})
    yield process
    process.stop()


@pytest.fixture(scope="module")
def model_id(tiny_llama_dir):
    return tiny_llama_dir.name


_SALTS = itertools.count(1)


def body(model_id: str, prompt_len: int, max_tokens: int, stream: bool) -> dict:
    """A greedy completion of a prompt no other request shares a block with: the prefix
    cache would otherwise serve a victim's prompt from a blocker's, and the victim would
    never wait where the test strikes it."""
    salt = next(_SALTS)
    prompt = [salt % 300 + 3] + [(11 * i + salt) % 300 + 3 for i in range(prompt_len - 1)]
    return {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


class RawRequest:
    """A POST over a bare socket, so the test decides when the client vanishes."""

    def __init__(self, url: str, payload: dict, tag: str):
        host, port = url.removeprefix("http://").split(":")
        data = json.dumps(payload).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nX-Request-Id: {tag}\r\nConnection: close\r\n\r\n"
        )
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(head.encode() + data)

    def vanish(self) -> None:
        self.sock.close()


def workers(server) -> list[dict]:
    return requests.get(f"{server.url}/admin/workers", timeout=10).json()["workers"]


def holdings(server, tag: str) -> dict[str, list[str]]:
    """Worker -> what it still holds for requests tagged `tag` (states and leases)."""
    held = {}
    for w in workers(server):
        mine = [f"{rid}:{state}" for rid, state in w.get("requests", {}).items() if tag in rid]
        mine += [f"{rid}:lease" for rid in w.get("leases", []) if tag in rid]
        if mine:
            held[w["worker_id"]] = mine
    return held


def wait_for(server, tag: str, role: str, state: str, timeout_s: float = 30.0) -> None:
    """Until the worker of `role` holds request `tag` in `state`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers(server):
            if w["role"] == role and any(
                tag in rid and s == state for rid, s in w.get("requests", {}).items()
            ):
                return
        time.sleep(0.01)
    raise AssertionError(f"{tag} never reached {role}:{state}; holdings {holdings(server, tag)}")


def seconds_until_released(server, tag: str, timeout_s: float = 10.0) -> float:
    start = time.monotonic()
    while holdings(server, tag):
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{tag} still held: {holdings(server, tag)}")
        time.sleep(0.01)
    return time.monotonic() - start


def assert_idle(server, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {
            w["worker_id"]: (w.get("used_blocks"), w.get("outstanding_leases"), w.get("requests"))
            for w in workers(server)
            if w.get("used_blocks") or w.get("outstanding_leases") or w.get("sequences")
        }
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"workers still hold KV: {busy}")
        time.sleep(0.05)


# phase -> (victim prompt, victim max_tokens, blocker prompt or None, blocker max_tokens,
#           where the victim waits: role, state)
PHASES = {
    "prefill_queue": (40, 8, 240, 4, "prefill", "waiting"),
    "prefill": (240, 8, None, 0, "prefill", "running+blocks"),
    "kv_transfer": (240, 8, None, 0, "decode", "importing+blocks"),
    "decode_admission": (100, 8, 200, 50, "decode", "importing"),
    "decode": (20, 200, None, 0, "decode", "running+blocks"),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_client_that_vanishes_frees_its_kv_at_once(server, model_id, phase, stream):
    prompt_len, max_tokens, blocker_len, blocker_tokens, role, state = PHASES[phase]
    tag = f"{phase}-{uuid.uuid4().hex[:6]}"
    blocker = None
    if blocker_len is not None:
        blocker = RawRequest(
            server.url, body(model_id, blocker_len, blocker_tokens, True), tag + "b"
        )
        wait_for(server, tag + "b", *_blocking_state(phase))
    victim = RawRequest(server.url, body(model_id, prompt_len, max_tokens, stream), tag + "v")
    wait_for(server, tag + "v", role, state)
    assert holdings(server, tag + "v"), "the victim held nothing before it vanished"

    victim.vanish()
    released_after = seconds_until_released(server, tag + "v")

    if blocker is not None:
        blocker.vanish()
    assert_idle(server)
    assert released_after < FREED_WITHIN_S, f"freed after {released_after:.2f} s"


def _blocking_state(phase: str) -> tuple[str, str]:
    # prefill_queue: the blocker fills the prefill step budget while it prefills;
    # decode_admission: the blocker's KV fills the decode pool while it decodes.
    return (
        ("prefill", "running+blocks") if phase == "prefill_queue" else ("decode", "running+blocks")
    )


def test_a_burst_of_abandoned_requests_leaves_nothing_behind(server, model_id):
    tag = f"burst-{uuid.uuid4().hex[:6]}"
    abandoned = [
        RawRequest(server.url, body(model_id, 120, 100, i % 2 == 0), f"{tag}-{i}")
        for i in range(16)
    ]
    time.sleep(0.3)  # some queued, some prefilling, some importing
    for request in abandoned:
        request.vanish()
    assert seconds_until_released(server, tag) < 5.0
    assert_idle(server)


def test_good_streams_after_abandoned_ones_all_finish_in_full(server, model_id):
    def stream_one(i: int) -> int:
        payload = body(model_id, 10 + i, 12, True)
        with requests.post(
            f"{server.url}/v1/completions", json=payload, stream=True, timeout=120
        ) as r:
            r.raise_for_status()
            tokens = 0
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    tokens += bool(chunk["choices"] and chunk["choices"][0]["text"])
            return tokens

    with ThreadPoolExecutor(8) as pool:
        finished = list(pool.map(stream_one, range(8)))
    assert all(n >= 1 for n in finished)
    usage = requests.post(
        f"{server.url}/v1/completions", json=body(model_id, 10, 12, False), timeout=120
    ).json()["usage"]
    assert usage["completion_tokens"] == 12
    assert_idle(server)


# --- bodies that used to crash a handler ------------------------------------------------


def test_json_sent_as_text_plain_is_refused_with_415_and_the_connection_kept(server, model_id):
    """A browser page may POST text/plain cross-origin without a preflight: such a body
    must not run a generation (tests/test_frontend_hardening.py has the other types)."""
    with requests.Session() as session:
        r = session.post(
            f"{server.url}/v1/completions",
            data=json.dumps(body(model_id, 5, 3, False)),
            headers={"Content-Type": "text/plain"},
            timeout=60,
        )
        assert r.status_code == 415, r.text
        assert "application/json" in r.json()["error"]["message"]
        r = session.post(f"{server.url}/v1/completions", json=body(model_id, 5, 3, False))
        assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 20_000 + "]" * 20_000,
        '{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        '{"model": "m", "prompt": "a", "stop": ' + json.dumps(["x"] * 100) + "}",
    ],
    ids=["nested_20000_deep", "lone_surrogate", "too_many_stops"],
)
def test_a_body_that_used_to_500_gets_a_4xx_and_keeps_the_connection(server, model_id, raw):
    raw = raw.replace('"m"', json.dumps(model_id))
    endpoint = "chat/completions" if "messages" in raw else "completions"
    with requests.Session() as session:
        r = session.post(
            f"{server.url}/v1/{endpoint}",
            data=raw.encode("utf-8", "surrogatepass"),
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) >= {"message", "type", "code"}
        # the same keep-alive connection serves the next request
        good = session.post(
            f"{server.url}/v1/completions", json=body(model_id, 5, 2, False), timeout=60
        )
        assert good.status_code == 200


# --- a few hundred malformed bodies -----------------------------------------------------

BAD_VALUES = {
    # (null is not here: like a body without `model`, it gets the served model, as in vLLM)
    "model": st.one_of(st.integers(), st.lists(st.text()), st.just("no-such-model")),
    "max_tokens": st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=(1 << 20) + 1),
        st.just(300),  # prompt + 300 > max_model_len (256)
        st.floats(0.1, 0.9),
        st.text(alphabet="abc", min_size=1),
    ),
    "temperature": st.one_of(st.floats(-1e6, -0.01), st.floats(100.01, 1e6), st.just("hot")),
    "top_p": st.one_of(st.just(0), st.floats(-5, -0.01), st.floats(1.01, 9)),
    "top_k": st.integers(max_value=-2),  # -1 and 0 disable it, as in vLLM
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=65, max_value=1000)),
    "stop": st.one_of(
        st.lists(st.just("x"), min_size=17, max_size=40),
        st.text(min_size=513, max_size=600),
        st.lists(st.integers(), min_size=1, max_size=3),
        st.just(""),
    ),
    "stream": st.one_of(st.lists(st.integers(), min_size=1), st.dictionaries(st.text(), st.text())),
    "logprobs": st.integers(21, 1000),
    "best_of": st.integers(2, 5),
    "prompt": st.one_of(
        st.just(""),
        st.just([]),
        st.lists(st.integers(min_value=384, max_value=10**9), min_size=1, max_size=5),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=5),
        st.lists(st.dictionaries(st.text(), st.integers()), min_size=1, max_size=3),
    ),
    "messages": st.one_of(
        st.just([]),
        st.lists(st.fixed_dictionaries({"role": st.just("wizard"), "content": st.text()})),
        st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.integers()}),
            min_size=1,
        ),
        st.text(),
    ),
}


def malformed_bodies(model_id: str):
    """One valid completion or chat body with one field made invalid, or a body that is
    not a JSON object at all. Every draw must be refused with a 4xx."""

    def spoil(kind_and_field):
        kind, field = kind_and_field
        good = {"model": model_id, "max_tokens": 4}
        good.update(
            {"messages": [{"role": "user", "content": "hi"}]}
            if kind == "chat"
            else {"prompt": "hi"}
        )
        return st.builds(lambda value: (kind, {**good, field: value}), BAD_VALUES[field])

    completion_fields = [f for f in BAD_VALUES if f != "messages"]
    chat_fields = [f for f in BAD_VALUES if f != "prompt"]
    fields = st.sampled_from(
        [("completions", f) for f in completion_fields] + [("chat", f) for f in chat_fields]
    )
    not_an_object = st.tuples(
        st.sampled_from(["completions", "chat"]),
        st.one_of(st.integers(), st.text(), st.lists(st.integers()), st.none()),
    )
    return st.one_of(fields.flatmap(spoil), not_an_object)


def test_hundreds_of_malformed_bodies_all_get_openai_4xx(server, model_id):
    session = requests.Session()
    statuses: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(malformed_bodies(model_id))
    def post(case):
        kind, payload = case
        endpoint = "chat/completions" if kind == "chat" else "completions"
        r = session.post(f"{server.url}/v1/{endpoint}", json=payload, timeout=30)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert 400 <= r.status_code < 500, (payload, r.status_code, r.text)
        error = r.json()["error"]
        assert error["message"] and error["code"] == r.status_code

    post()
    assert sum(statuses.values()) >= 300
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    good = session.post(
        f"{server.url}/v1/completions", json=body(model_id, 5, 2, False), timeout=60
    )
    assert good.status_code == 200
    assert_idle(server)
