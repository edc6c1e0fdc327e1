"""Per-request limits (cluster/api/request_limits.py): each one refuses a body past it with a
400 naming the parameter and the limit, through the parser and through the HTTP app;
repeated stop_token_ids count once; `pdserve serve` has a flag per limit (no Ray)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest

from cluster.api.frontend import FrontendSettings, build_app
from cluster.api.openai_protocol import ApiError, parse_body
from cluster.api.request_limits import RequestLimits, limits_from_args
from cluster.cli.main import build_parser
from cluster.control.metrics import ClusterMetrics

SMALL = RequestLimits(
    max_logit_bias_entries=2,
    max_stop_token_ids=3,
    max_stop_strings=2,
    max_stop_string_chars=4,
    max_choices=4,
)


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hi", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("body", "at_limit", "param", "limit"),
    [
        (
            completion(logit_bias={"1": 1, "2": 1, "3": 1}),
            completion(logit_bias={"1": 1, "2": 1}),
            "logit_bias",
            2,
        ),
        (
            completion(stop_token_ids=[1, 2, 3, 4]),
            completion(stop_token_ids=[1, 2, 3, 3, 1]),
            "stop_token_ids",
            3,
        ),
        (chat(stop=["a", "b", "c"]), chat(stop=["a", "b"]), "stop", 2),
        (chat(stop="abcde"), chat(stop="abcd"), "stop", 4),
        (completion(n=5), completion(n=4), "n", 4),
        (completion(prompt=["a", "b"], n=3), completion(prompt=["a", "b"], n=2), "n", 4),
    ],
)
def test_a_body_past_a_limit_gets_a_400_naming_the_parameter_and_the_limit(
    body, at_limit, param, limit
):
    kind = "chat" if "messages" in body else "completion"
    with pytest.raises(ApiError) as caught:
        parse_body(kind, body, SMALL)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert f"at most {limit} " in caught.value.message or f"and {limit}," in caught.value.message
    assert parse_body(kind, at_limit, SMALL).num_choices <= SMALL.max_choices


def test_the_defaults_are_openais_logit_bias_cap_and_the_former_constants():
    assert RequestLimits() == RequestLimits(300, 64, 16, 512, 64)
    bias = {str(t): 1.0 for t in range(301)}
    with pytest.raises(ApiError) as caught:
        parse_body("completion", completion(logit_bias=bias))
    assert caught.value.param == "logit_bias" and "at most 300 " in caught.value.message
    del bias["300"]
    assert len(parse_body("completion", completion(logit_bias=bias)).params.logit_bias) == 300
    with pytest.raises(ApiError):
        parse_body("completion", completion(stop_token_ids=list(range(65))))
    with pytest.raises(ApiError):
        parse_body("completion", completion(n=65))


def test_repeated_stop_token_ids_are_folded_in_the_order_sent():
    body = completion(stop_token_ids=[9, 4, 9, 9, 4, 2] * 40)
    assert parse_body("completion", body, SMALL).params.stop_token_ids == (9, 4, 2)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8"])
def test_a_limit_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="max_choices must be a positive integer"):
        RequestLimits(max_choices=value)


FLAGS = {
    "max_logit_bias_entries": "--max-logit-bias-entries",
    "max_stop_token_ids": "--max-stop-token-ids",
    "max_stop_strings": "--max-stop-strings",
    "max_stop_string_chars": "--max-stop-string-chars",
    "max_choices": "--max-choices",
}


def test_pdserve_serve_has_a_flag_per_limit_with_its_default():
    assert set(FLAGS) == {f.name for f in fields(RequestLimits)}
    help_text = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    flat = " ".join(help_text.split())
    for name, flag in FLAGS.items():
        assert f"{flag} {name.upper()}" in flat
        assert f"(default: {getattr(RequestLimits(), name)})" in flat

    given = ["serve", "--max-choices", "8", "--max-logit-bias-entries", "1000"]
    limits = limits_from_args(build_parser().parse_args(given))
    assert limits == RequestLimits(max_logit_bias_entries=1000, max_choices=8)
    assert limits_from_args(build_parser().parse_args(["serve"])) == RequestLimits()
    with pytest.raises(SystemExit, match="max_stop_strings must be a positive integer"):
        limits_from_args(build_parser().parse_args(["serve", "--max-stop-strings", "0"]))


# --- through the HTTP app ------------------------------------------------------------


def post(app, path: str, body: dict) -> tuple[int, dict]:
    """One POST through the ASGI app, in this process (status, JSON body)."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(raw))],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(content)


def test_the_frontend_parses_with_its_settings_limits():
    """A body the default limits take is refused under the server's lower ones: the
    frontend hands its `FrontendSettings.limits` to the parser. (A cluster that is never
    reached: the body is refused before anything else happens.)"""
    live = SimpleNamespace(live=lambda role: ["w"] if role == "colocated" else [])
    cluster = SimpleNamespace(
        on_finish=[], model_id="m", config=SimpleNamespace(model="m"), tokenizer=None, router=live
    )
    app = build_app(cluster, FrontendSettings(limits=SMALL), ClusterMetrics())

    status, body = post(app, "/v1/completions", completion(n=5))
    assert status == 400
    assert body["error"]["param"] == "n" and "between 1 and 4" in body["error"]["message"]
    status, body = post(app, "/v1/chat/completions", chat(stop_token_ids=[1, 2, 3, 4]))
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "stop_token_ids", 400)
    assert "at most 3 distinct" in body["error"]["message"]
