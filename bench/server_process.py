"""Runs `pdserve serve` as a real subprocess on a free loopback port.

Used by the experiments that need a fresh server per configuration (bandwidth sweep)
and by the tests that drive a live server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import requests


def free_port() -> int:
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
    ):
        """`port`: where the server listens (default: a free one)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(self.port), *args]
        self.output_path = f"/tmp/pdserve-serve-{self.port}.log"
        self.log = open(self.output_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout_s}s: {self.output()}")

    def output(self) -> str:
        with open(self.output_path) as handle:
            return handle.read()[-4000:]

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
