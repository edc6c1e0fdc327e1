"""What a live `pdserve serve` with a local Ray head listens on: every socket of its
process tree (the server, Ray's GCS, raylet, agents and monitors, the worker processes
and their KV transports) on loopback, and the head refuses a caller without its token."""

from __future__ import annotations

import dataclasses
import uuid

import psutil
import pytest

from bench.server_process import ServerProcess
from cluster.control.ray_access import is_loopback
from tests.cluster_helpers import assert_gcs_refuses_strangers

pytestmark = pytest.mark.slow

MARKER_ENV = "PDSERVE_LISTENER_TEST"
"""Set in the server's environment, so every process the server starts carries it,
wherever it sits in the process table."""

SERVERS = {
    # auto starts the shm and the collective transports' servers (control channels and
    # the collective's TCPStore); the HTTP server alone is asked onto every interface
    "disaggregated-auto-http-on-all-interfaces": ["--transport", "auto", "--host", "0.0.0.0"],
    "disaggregated-grpc": ["--transport", "grpc"],
}


@dataclasses.dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.pid:>7} {self.process:<28} {self.ip}:{self.port}"


def server_args(model_dir, extra: list[str]) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--drain-timeout-s", "0", *extra]


def listeners_of(processes: list[psutil.Process]) -> list[Listener]:
    found = []
    for process in processes:
        try:
            name = process.name()
            sockets = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found += [
            Listener(process.pid, name, s.laddr.ip, s.laddr.port)
            for s in sockets
            if s.status == psutil.CONN_LISTEN
        ]
    return sorted(found, key=lambda listener: (listener.pid, listener.port))


def carrying_marker(marker: str) -> set[int]:
    """Every process of this user whose environment holds `marker`."""
    pids = set()
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER_ENV) == marker:
                pids.add(process.pid)
        except psutil.Error:  # another user's process, or one that ended meanwhile
            continue
    return pids


def start(model_dir, extra: list[str]) -> tuple[ServerProcess, str]:
    marker = uuid.uuid4().hex
    return ServerProcess(server_args(model_dir, extra), env={MARKER_ENV: marker}), marker


def stop(server: ServerProcess) -> None:
    leftovers = server.stop()
    assert server.proc.returncode == 0, server.output()
    assert not leftovers, f"processes left after SIGTERM: {[p.pid for p in leftovers]}"


@pytest.mark.parametrize("extra", list(SERVERS.values()), ids=list(SERVERS))
def test_every_listener_of_the_server_and_its_ray_head_is_on_loopback(
    tiny_llama_dir, extra, tmp_path
):
    """The server's descendants are all its processes (Ray's and the workers' among them:
    every process carrying the server's environment marker is one), and none of them
    listens off loopback but the HTTP server where `--host` asks for it. Ray's token
    authentication is on for the local head: its GCS answers a client with no token, or
    with another one, with an authentication error."""
    server, marker = start(tiny_llama_dir, extra)
    try:
        tree = [psutil.Process(server.proc.pid), *server.descendants()]
        found = listeners_of(tree)
        print("\n".join(map(str, found)))
        names = {listener.process for listener in found}
        assert {"gcs_server", "raylet", "ray::DashboardAgent"} <= names
        assert carrying_marker(marker) <= {process.pid for process in tree}
        off_loopback = [listener for listener in found if not is_loopback(listener.ip)]
        expected = [(server.proc.pid, "0.0.0.0", server.port)] if "--host" in extra else []
        assert [(item.pid, item.ip, item.port) for item in off_loopback] == expected
        gcs = next(listener for listener in found if listener.process == "gcs_server")
        assert_gcs_refuses_strangers(f"127.0.0.1:{gcs.port}", tmp_path)
    finally:
        stop(server)
