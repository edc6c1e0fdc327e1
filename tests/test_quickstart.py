"""The README quick start, executed as written: `make serve`, then the curl it prints."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.demo]

ROOT = Path(__file__).resolve().parent.parent


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_make_serve_then_the_printed_curl_answers():
    command = ["make", "serve"]
    if not port_is_free(8000):  # a developer's own server: same sequence on another port
        command.append("SERVE_ARGS=--port 8765")
    log_path = Path("/tmp/pdserve-quickstart.log")
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        curl_line = wait_for_curl_line(log_path, server, timeout_s=300)
        result = subprocess.run(
            shlex.split(curl_line), capture_output=True, text=True, timeout=120, check=True
        )
        answer = json.loads(result.stdout)
        assert "Paris" in answer["choices"][0]["message"]["content"]
    finally:
        stop_tree(server)


def wait_for_curl_line(log_path: Path, server: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(r"^try: (curl .*)$", log_path.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
        assert server.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.5)
    raise TimeoutError(log_path.read_text()[-3000:])


def stop_tree(server: subprocess.Popen) -> None:
    """SIGTERM to the whole `make` session; the server shuts its workers and Ray down."""
    children = psutil.Process(server.pid).children(recursive=True)
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
