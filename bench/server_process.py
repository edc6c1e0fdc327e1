"""Runs `pdserve serve` as a real subprocess on a free loopback port.

The server binds the port itself (`--port 0`) and this reads it from its announcement:
a port picked here and handed over could be taken, in the seconds before the server
binds it, by any connection that Ray or the workers open.

Used by the experiments that need a fresh server per configuration (bandwidth sweep)
and by the tests that drive a live server.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import requests

ANNOUNCEMENT = re.compile(r"pdserve listening on (https?)://[^\s:]+:(\d+)")


def free_port() -> int:
    """A port free now, for a server that cannot bind port 0 and tell (Prometheus,
    vLLM); it may be taken before that server binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        env: dict | None = None,
        startup_timeout_s: float = 300.0,
        port: int | None = None,
        verify: str | bool = True,
    ):
        """`port`: where the server listens (default: one the server picks and announces);
        `verify`: the CA file its HTTPS certificate is checked against, when it serves
        HTTPS (`--ssl-certfile`)."""
        self.port = port or 0
        self.url = ""
        self.verify = verify
        command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(self.port), *args]
        handle, self.output_path = tempfile.mkstemp(prefix="pdserve-serve-", suffix=".log")
        self.log = os.fdopen(handle, "w")
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            if not self.url and not self._read_announcement():
                time.sleep(0.5)
                continue
            try:
                health = requests.get(f"{self.url}/health", timeout=2, verify=self.verify)
                if health.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout_s}s: {self.output()}")

    def _read_announcement(self) -> bool:
        found = ANNOUNCEMENT.search(self.output(tail=None))
        if found:
            self.port = int(found.group(2))
            self.url = f"{found.group(1)}://127.0.0.1:{self.port}"
        return bool(found)

    def output(self, tail: int | None = 4000) -> str:
        with open(self.output_path) as handle:
            text = handle.read()
        return text if tail is None else text[-tail:]

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> list[psutil.Process]:
        """Signal the server, wait for it; returns descendants still alive afterwards."""
        children = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        _, alive = psutil.wait_procs(children, timeout=20)
        self.log.close()
        return alive
