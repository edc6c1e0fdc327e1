"""One client cannot take the server down: a live `pdserve serve` (colocated, tiny
model) fed what an attacker would send. Every case ends with the server still serving."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import ssl
import threading
import time

import psutil
import pytest
import requests

from bench.server_process import ServerProcess
from tests.tls_certs import make_test_certificate

pytestmark = pytest.mark.slow

API_KEY = "tenant-key"
ADMIN_KEY = "operator-key"
READ_TIMEOUT_S = 2.0
CONNECTION_LIMIT = 12
MAX_BODY = 4 << 20
TENANT = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = [
        "--model", str(tiny_llama_dir), "--mode", "colocated", "--dtype", "float32",
        "--block-size", "8", "--decode-kv-blocks", "400", "--max-model-len", "512",
        "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
        "--read-timeout-s", str(READ_TIMEOUT_S), "--limit-concurrency", str(CONNECTION_LIMIT),
        "--health-interval-s", "0.2",
    ]  # fmt: skip
    process = ServerProcess(args)
    yield process
    leftovers = process.stop()
    assert not leftovers, f"processes left after SIGTERM: {[p.pid for p in leftovers]}"


@pytest.fixture(scope="module")
def model_id(tiny_llama_dir):
    return tiny_llama_dir.name


def completion(server, model_id, **fields) -> requests.Response:
    body = {"model": model_id, "prompt": "still serving", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, **fields}  # fmt: skip
    return requests.post(f"{server.url}/v1/completions", json=body, headers=TENANT, timeout=30)


def assert_serving(server, model_id) -> None:
    response = completion(server, model_id)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_status(sock: socket.socket) -> tuple[int, bytes]:
    """The status code and the whole answer of a `Connection: close` response (a server
    that closes with a body left unread resets the connection after its answer)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def rss(server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


@pytest.mark.parametrize(
    "content_type, status",
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json; charset=utf-8", 200),
        ("application/vnd.api+json", 200),
        (None, 200),
    ],
)
def test_only_json_bodies_are_read(server, model_id, content_type, status):
    """A browser page can POST text/plain (and forms) cross-origin without a preflight:
    such a body must not drive generations on a local server."""
    body = json.dumps({"model": model_id, "prompt": "x", "max_tokens": 1}).encode()
    headers = dict(TENANT)
    if content_type is not None:
        headers["Content-Type"] = content_type
    response = requests.post(f"{server.url}/v1/completions", data=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    if status == 415:
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert_serving(server, model_id)


def test_a_body_that_rescans_quadratically_gets_a_4xx_at_once_and_health_keeps_answering(
    server, model_id
):
    body = b'{"model": "m", "prompt": "' + b'\\"' * (200 << 10)  # 400 KB, never terminated
    health_times: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            requests.get(f"{server.url}/health", timeout=10)
            health_times.append(time.perf_counter() - started)

    poller = threading.Thread(target=poll_health)
    poller.start()
    started = time.perf_counter()
    response = requests.post(
        f"{server.url}/v1/completions",
        data=body,
        headers={**TENANT, "Content-Type": "application/json"},
        timeout=30,
    )
    elapsed = time.perf_counter() - started
    stop.set()
    poller.join()

    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    assert elapsed < 1.0, f"answered after {elapsed:.2f} s"
    assert health_times and max(health_times) < 1.0, health_times
    assert_serving(server, model_id)


def test_a_chunked_body_past_the_limit_is_cut_before_16_mib_and_memory_stays_flat(server, model_id):
    before = rss(server)
    sock = connect(server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    piece = b"x" * (64 << 10)
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent, pending = 0, b""
    sock.setblocking(False)
    while sent < 256 << 20:
        readable, writable, _ = select.select([sock], [sock], [], 5)
        if readable or not writable:
            break  # the answer is in (or the server stopped reading)
        pending = pending or frame
        try:
            written = sock.send(pending)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent, pending = sent + written, pending[written:]
    sock.setblocking(True)
    sock.settimeout(10)
    status, answer = read_status(sock)
    sock.close()
    grown = rss(server) - before

    print(
        f"413 after {sent / (1 << 20):.1f} MiB sent; frontend RSS grew {grown / (1 << 20):.1f} MiB"
    )
    assert status == 413, answer
    assert sent < 16 << 20
    assert grown < 32 << 20
    assert_serving(server, model_id)


def _closed_by_the_server(sock) -> bool:
    """Whether the server closed `sock` within its timeout: an orderly end, or a reset
    where the headers the server never read were still queued (the kernel answers
    those with RST)."""
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_headers_that_trickle_in_are_cut_at_the_read_deadline(server, model_id):
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    started = time.perf_counter()
    closed_after = None
    for _ in range(20):
        try:
            sock.sendall(b"X-Slow: a\r\n")
        except OSError:
            closed_after = time.perf_counter() - started
            break
        sock.settimeout(0.5)
        if _closed_by_the_server(sock):
            closed_after = time.perf_counter() - started
            break
    sock.close()
    assert closed_after is not None and closed_after < READ_TIMEOUT_S + 1.5, closed_after
    assert_serving(server, model_id)


def test_a_body_that_never_arrives_gets_408(server, model_id):
    sock = connect(server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
        b"Content-Length: 100\r\nConnection: close\r\n\r\n" + b'{"prompt": '
    )
    started = time.perf_counter()
    status, answer = read_status(sock)
    sock.close()
    assert status == 408, answer
    assert time.perf_counter() - started < READ_TIMEOUT_S + 1.5
    assert_serving(server, model_id)


def test_connections_past_the_limit_get_a_json_503(server, model_id):
    idle = [connect(server) for _ in range(CONNECTION_LIMIT)]
    try:
        extra = connect(server)
        status, answer = read_status(extra)
        extra.close()
    finally:
        for sock in idle:
            sock.close()
    assert status == 503, answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
    time.sleep(0.2)
    assert_serving(server, model_id)


def test_the_admin_endpoints_take_the_admin_key_not_a_tenants(server):
    url = f"{server.url}/admin/workers"
    assert requests.get(url, headers=TENANT, timeout=10).status_code == 401
    assert requests.get(url, timeout=10).status_code == 401
    admin = requests.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert admin.status_code == 200 and admin.json()["workers"]
    models = requests.get(
        f"{server.url}/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert models.status_code == 401, "the admin key is not a tenant's key either"


def test_prefix_cache_hits_are_not_disclosed_by_default(server, model_id):
    prompt = [(7 * i) % 300 + 3 for i in range(40)]
    for _ in range(2):  # the second finds the first's blocks cached
        response = completion(server, model_id, prompt=prompt)
    body = response.json()
    assert "prompt_tokens_details" not in body["usage"]
    timings = body["pdserve_timings"]
    assert "cached_tokens" not in timings and "route" not in timings
    assert timings["ttft_s"] > 0, "the rest of the breakdown stays"


def test_nested_tool_call_arguments_are_the_clients_problem_not_a_500(server, model_id):
    arguments = "[" * 5000 + "]" * 5000
    messages = [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]  # fmt: skip
    response = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model_id, "messages": messages, "max_tokens": 2},
        headers=TENANT,
        timeout=30,
    )
    assert response.status_code in (200, 400), response.text
    assert_serving(server, model_id)


def test_https_with_a_certificate(tiny_llama_dir, tmp_path):
    cert, key, ca = make_test_certificate(tmp_path)
    args = [
        "--model", str(tiny_llama_dir), "--mode", "colocated", "--dtype", "float32",
        "--block-size", "8", "--decode-kv-blocks", "200", "--max-model-len", "512",
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
    ]  # fmt: skip
    process = ServerProcess(args, verify=str(ca))
    try:
        assert process.url.startswith("https://")
        body = {"model": tiny_llama_dir.name, "prompt": "x", "max_tokens": 2, "ignore_eos": True}
        answer = requests.post(
            f"{process.url}/v1/completions", json=body, verify=str(ca), timeout=30
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{process.url}/health", timeout=10)  # no CA: not trusted
        plain = process.url.replace("https://", "http://")
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"{plain}/health", timeout=10)
        context = ssl.create_default_context(cafile=str(ca))
        with (
            socket.create_connection(("127.0.0.1", process.port)) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
        idle = requests.Session()  # a kept-alive TLS connection left open, as clients do
        assert idle.get(f"{process.url}/health", verify=str(ca), timeout=10).ok
        stopping = time.monotonic()
    finally:
        leftovers = process.stop()
    # Well inside uvicorn's 30 s grace: an idle connection is dropped, not waited on for
    # its TLS close_notify (asyncio's 30 s ssl_shutdown_timeout).
    assert time.monotonic() - stopping < 15
    assert not leftovers
    idle.close()
