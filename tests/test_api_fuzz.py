"""Property-based fuzzing of the HTTP API from the OpenAPI schema the server itself serves
(schemathesis): whatever the bodies, parameters and headers, no answer is a 5xx and every
error is an OpenAI-style JSON body. A live colocated server on a tiny model, its context
short so that valid generations stay quick."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
REACHED = {"/v1/completions", "/v1/chat/completions", "/tokenize"}
"""Routes the fuzzer must get through to a 200 at least once: its cases reach the
generation code, not only the validation in front of it."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = [
        "--model", str(tiny_llama_dir), "--mode", "colocated", "--dtype", "float32",
        "--block-size", "8", "--decode-kv-blocks", "256", "--max-model-len", "48",
        "--api-key", API_KEY, "--health-interval-s", "0.5",
    ]  # fmt: skip
    process = ServerProcess(args)
    yield process
    leftovers = process.stop()
    assert process.proc.returncode == 0, process.output()
    assert not leftovers


SEEN: dict[tuple[str, int], int] = {}
"""(path, status) -> answers seen, to show what the fuzzer reached."""


def openai_error_body(ctx, response, case) -> None:
    """A 4xx answer names what went wrong the way OpenAI's API does."""
    key = (case.operation.path, response.status_code)
    SEEN[key] = SEEN.get(key, 0) + 1
    if 400 <= response.status_code < 500:
        error = json.loads(response.content)["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str) and error["code"] == response.status_code, error


def test_no_input_gets_a_5xx_and_every_error_is_openai_shaped(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    authorized = {"Authorization": f"Bearer {API_KEY}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= REACHED
    for operation in operations:
        # The generation routes get more cases: most random bodies are refused (empty
        # prompts, ids outside the vocabulary, top_p out of range), and some must pass.
        examples = 100 if operation.path in REACHED else 25

        @given(case=operation.as_strategy())
        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,  # the same cases on every machine: a pass is not luck
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case) -> None:
            case.call_and_validate(
                headers=authorized, checks=[not_a_server_error, openai_error_body], timeout=60
            )

        fuzz()
    print(sorted(SEEN.items()))
    reached = {path for (path, status), _ in SEEN.items() if status == 200}
    assert reached >= REACHED, SEEN
