"""The KV transfer listeners against clients that do not play by the rules.

Control server (`shm`, `collective`): a first message is capped and read by a
deadline before the token is checked, malformed first messages close only their own
connection, connections past the bound are closed at once. gRPC: a call without the
token is refused from its metadata, its request unread, and requests are capped small.
TLS on gRPC and on the control channel, with certificates made here. Options refuse a
listener off loopback without a token; the collective store listens on `bind_host`
only and gloo pair devices bind the address peers dial; cancelled fetch ids age out.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import re
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from cluster.config import ClusterConfig, ConfigError
from kv_transfer import FailureReason, TransportOptions, make_receiver, make_sender
from kv_transfer.control import FIRST_MESSAGE_BYTES, ControlConnection, ControlServer
from kv_transfer.receiver import CANCEL_MEMORY_IDS, _Cancellations
from kv_transfer.transports import collective
from kv_transfer.transports import grpc as grpc_transport
from proto import kv_transfer_pb2 as pb
from tests.kv_transfer_peer import random_pool

TOKEN = "cluster-secret"
OPTIONS = TransportOptions(token=TOKEN, timeout_s=5.0, chunk_bytes=16 << 10)
HEADER = struct.Struct("!I")
BLOCKS, DST = [1, 2, 3], [7, 8, 9]


# --- control server ------------------------------------------------------------------


def echo(conn: socket.socket, first: dict) -> None:
    """Handler of the test servers: answers every request with its op, until closed."""
    from kv_transfer.control import recv_message, send_message

    message = first
    while True:
        send_message(conn, {"ok": True, "op": message.get("op")})
        message = recv_message(conn)


@pytest.fixture
def control_server():
    servers = []

    def start(**overrides) -> ControlServer:
        servers.append(ControlServer(replace(OPTIONS, **overrides), echo, "test-control"))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def thread_crashes(monkeypatch):
    """Exceptions that escaped any thread while the test ran."""
    crashes = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashes.append(args.exc_value))
    return crashes


def raw_connection(server: ControlServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.settimeout(5)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (EOF or reset) with nothing sent to us first."""
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def served(server: ControlServer, options: TransportOptions = OPTIONS) -> bool:
    conn = ControlConnection("127.0.0.1", server.port, options, 5)
    try:
        return conn.call({"op": "ping"}) == {"ok": True, "op": "ping"}
    finally:
        conn.close()


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def test_a_first_header_announcing_16_mib_is_cut_off_after_the_header(control_server):
    server = control_server()
    sock = raw_connection(server)
    # 1. only the header: the server must close without waiting for the body
    sock.sendall(HEADER.pack(16 << 20))
    assert closed_by_server(sock)
    # 2. so the body has nowhere to go: the send breaks long before its end
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(16):
            sock.sendall(b"x" * (1 << 20))
    sock.close()
    # 3. the first-message cap is the small one, and the server still serves
    assert FIRST_MESSAGE_BYTES == 64 << 10
    assert served(server)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls-handshake"])
def test_a_connection_that_sends_nothing_is_closed_at_the_auth_deadline(
    tls, control_server, certificates, tmp_path
):
    fields = tls_fields(certificates) if tls else {}
    server = control_server(auth_timeout_s=0.3, **fields)
    sock = raw_connection(server)
    assert closed_by_server(sock)  # before our own 5 s timeout
    sock.close()
    assert served(server, replace(OPTIONS, **fields))


def test_a_first_message_trickled_past_the_deadline_is_never_served(control_server):
    """Slowloris: every byte arrives in time for a per-read timeout, the whole message
    does not arrive in time for the deadline; the server closes before it is complete."""
    server = control_server(auth_timeout_s=0.3)
    body = json.dumps({"op": "ping", "token": TOKEN, "pad": "x" * 400}).encode()
    message = frame(body)
    sock = raw_connection(server)
    sent = 0
    try:
        for sent in range(len(message)):
            sock.sendall(message[sent : sent + 1])
            time.sleep(0.01)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < len(message) - 1, "the server waited for the whole trickled message"
    assert closed_by_server(sock)
    sock.close()


MALFORMED = {
    "non-ascii token": (frame(json.dumps({"op": "ping", "token": "sécret"}).encode()), True),
    "token not a string": (frame(json.dumps({"op": "ping", "token": 12345}).encode()), True),
    "lone surrogate token": (frame(b'{"op": "ping", "token": "\\ud800"}'), True),
    "array": (frame(b"[1, 2, 3]"), False),
    "string": (frame(b'"token"'), False),
    "null": (frame(b"null"), False),
    "bad utf-8": (frame(b'{"token": "\xff\xfe"}'), False),
    "not json": (frame(b"{token"), False),
    "deep nesting": (frame(b"[" * 60000), False),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_first_message_closes_only_its_connection(
    case, control_server, thread_crashes, caplog
):
    payload, answered = MALFORMED[case]
    server = control_server()
    sock = raw_connection(server)
    sock.sendall(payload)
    if answered:  # a token that is not ours: refused in words, then closed
        (length,) = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        reply = json.loads(sock.recv(length, socket.MSG_WAITALL))
        assert reply == {"ok": False, "reason": "unauthorized"}
    assert closed_by_server(sock)
    sock.close()
    assert served(server)
    assert thread_crashes == []
    assert "control connection failed" not in caplog.text  # not left to the catch-all


def test_connections_past_the_bound_are_closed_while_admitted_ones_keep_working(
    control_server,
):
    server = control_server(max_connections=2)
    held = [ControlConnection("127.0.0.1", server.port, OPTIONS, 5) for _ in range(2)]
    for conn in held:
        assert conn.call({"op": "hold"}) == {"ok": True, "op": "hold"}
    # 1. a third connection is closed at once, before it sends a byte
    extra = raw_connection(server)
    assert closed_by_server(extra)
    extra.close()
    # 2. the admitted ones are still served
    for conn in held:
        assert conn.call({"op": "again"}) == {"ok": True, "op": "again"}
    # 3. a slot freed is a slot for the next client
    held.pop().close()
    deadline = time.monotonic() + 5
    while not _try_served(server):
        assert time.monotonic() < deadline, "the closed connection's slot never came back"
        time.sleep(0.02)
    held.pop().close()


def _try_served(server: ControlServer) -> bool:
    try:
        return served(server)
    except (ConnectionError, OSError):
        return False


# --- gRPC ----------------------------------------------------------------------------


@pytest.fixture
def servicer_calls(monkeypatch):
    """Every call that reached the gRPC servicer's methods (patched before the server
    is built, so the server's handlers are these)."""
    calls = []

    def record(name):
        def method(self, request, context):
            calls.append(name)
            context.abort(grpc.StatusCode.INTERNAL, "the test servicer serves nothing")

        return method

    monkeypatch.setattr(grpc_transport._Servicer, "Fetch", record("Fetch"))
    monkeypatch.setattr(grpc_transport._Servicer, "Heartbeat", record("Heartbeat"))
    return calls


def grpc_fetch(sender, request: pb.FetchRequest, token: str):
    address = sender.endpoint().grpc.address
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        fetch = channel.unary_stream(
            f"/{grpc_transport.SERVICE}/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=pb.FetchResponse.FromString,
        )
        call = fetch(request, timeout=5, metadata=[(grpc_transport.TOKEN_KEY, token)])
        with pytest.raises(grpc.RpcError) as error:
            list(call)
    return error.value.code()


HUGE_REQUEST = pb.FetchRequest(request_id="r" * (16 << 20), receiver_id="d")


def test_grpc_refuses_an_unauthenticated_16_mib_request_before_the_servicer(servicer_calls):
    sender = make_sender("grpc", "prefill-0", random_pool(), OPTIONS)
    try:
        code = grpc_fetch(sender, HUGE_REQUEST, "guess")
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)
        small = pb.FetchRequest(request_id="r", receiver_id="d", dst_block_ids=DST)
        assert grpc_fetch(sender, small, "guess") == grpc.StatusCode.UNAUTHENTICATED
        # with the token, 16 MiB is still far past what a request may be
        assert grpc_fetch(sender, HUGE_REQUEST, TOKEN) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert servicer_calls == []
        # and the servicer is reached by a call that deserves it
        assert grpc_fetch(sender, small, TOKEN) == grpc.StatusCode.INTERNAL
        assert servicer_calls == ["Fetch"]
    finally:
        sender.close()


def test_grpc_calls_past_the_bound_are_refused(monkeypatch):
    release, entered = threading.Event(), threading.Semaphore(0)

    def held_heartbeat(self, request, context):
        entered.release()
        release.wait(5)
        return pb.HeartbeatReply(alive=False)

    monkeypatch.setattr(grpc_transport._Servicer, "Heartbeat", held_heartbeat)
    sender = make_sender("grpc", "prefill-0", random_pool(), replace(OPTIONS, max_connections=2))
    address = sender.endpoint().grpc.address
    metadata = [(grpc_transport.TOKEN_KEY, TOKEN)]
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(2) as pool:
        beat = channel.unary_unary(
            f"/{grpc_transport.SERVICE}/Heartbeat",
            request_serializer=pb.HeartbeatRequest.SerializeToString,
            response_deserializer=pb.HeartbeatReply.FromString,
        )
        request = pb.HeartbeatRequest(request_id="r")
        held = [pool.submit(beat, request, timeout=10, metadata=metadata) for _ in range(2)]
        for _ in held:
            assert entered.acquire(timeout=5)
        with pytest.raises(grpc.RpcError) as error:
            beat(request, timeout=5, metadata=metadata)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert [future.result().alive for future in held] == [False, False]
    sender.close()


# --- TLS -----------------------------------------------------------------------------


def _write_certificates(directory: Path) -> dict[str, str]:
    """A CA, and two server certificates it signed: one for IP 127.0.0.1, one for the
    DNS name `pdserve-kv` alone (the shared-certificate deployment)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject, issuer, public_key, signer, sans, ca: bool):
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(signer, hashes.SHA256())

    def write(name: str, data: bytes) -> str:
        path = directory / name
        path.write_bytes(data)
        return str(path)

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("pdserve test CA", "pdserve test CA", ca_key.public_key(), ca_key, [], True)
    paths = {"ca": write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))}
    for label, sans in (
        ("ip", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("name", [x509.DNSName("pdserve-kv")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = build(f"kv-{label}", "pdserve test CA", key.public_key(), ca_key, sans, False)
        paths[f"{label}_cert"] = write(
            f"{label}.pem", cert.public_bytes(serialization.Encoding.PEM)
        )
        paths[f"{label}_key"] = write(f"{label}.key", pem_key(key))
    return paths


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, str]:
    return _write_certificates(tmp_path_factory.mktemp("tls"))


def tls_fields(certificates, variant: str = "ip") -> dict[str, str]:
    return {
        "tls_certfile": certificates[f"{variant}_cert"],
        "tls_keyfile": certificates[f"{variant}_key"],
        "tls_ca_file": certificates["ca"],
    }


def tls_options(certificates, shm_dir, variant: str = "ip", **overrides) -> TransportOptions:
    fields = {**tls_fields(certificates, variant), **overrides}
    return replace(OPTIONS, shm_dir=str(shm_dir), **fields)


def fetch_with(transport: str, sender, options: TransportOptions, request_id: str):
    """A fresh receiver with `options` fetches one export; (result, its pool)."""
    ticket = sender.export(request_id, BLOCKS, 24, "decode-0")
    pool = random_pool(seed=9)
    receiver = make_receiver(transport, f"decode-{request_id}", pool, options)
    try:
        return receiver.fetch(ticket, DST, timeout_s=5), pool
    finally:
        receiver.close()


TLS_CASES = {
    "grpc": ("grpc", "ip", {}),
    "grpc-shared-cert": ("grpc", "name", {"tls_server_name": "pdserve-kv"}),
    "shm": ("shm", "ip", {}),
    "shm-shared-cert": ("shm", "name", {"tls_server_name": "pdserve-kv"}),
    "collective": ("collective", "ip", {}),
}


@pytest.mark.parametrize("case", list(TLS_CASES))
def test_blocks_move_over_tls_and_receivers_without_the_ca_are_refused(
    case, certificates, tmp_path
):
    transport, variant, overrides = TLS_CASES[case]
    options = tls_options(certificates, tmp_path, variant, **overrides)
    source = random_pool(seed=1)
    sender = make_sender(transport, "prefill-0", source, options)
    try:
        # 1. a receiver with the CA: the bytes arrive
        result, pool = fetch_with(transport, sender, options, "with-ca")
        assert result.ok, result.message
        assert torch.equal(pool.read_blocks(DST), source.read_blocks(BLOCKS))
        # 2. without the CA (system trust store), or without TLS: nothing moves
        no_ca = replace(options, tls_ca_file=None)
        plain = replace(OPTIONS, shm_dir=str(tmp_path))
        for request_id, refused in (("no-ca", no_ca), ("plain", plain)):
            before = random_pool(seed=9).kv
            result, pool = fetch_with(transport, sender, refused, request_id)
            assert result.reason == FailureReason.PEER_DIED, (request_id, result)
            assert torch.equal(pool.kv, before), request_id
        assert sender.stats().transfers_served == 1
    finally:
        sender.close()


def test_the_server_name_is_checked(certificates, tmp_path):
    """The shared certificate names `pdserve-kv`, not 127.0.0.1: a receiver that checks
    the dialled address (no `tls_server_name`) refuses it."""
    options = tls_options(certificates, tmp_path, "name", tls_server_name="pdserve-kv")
    sender = make_sender("grpc", "prefill-0", random_pool(seed=1), options)
    try:
        wrong_name = replace(options, tls_server_name=None)
        result, _ = fetch_with("grpc", sender, wrong_name, "by-address")
        assert result.reason == FailureReason.PEER_DIED, result
        assert sender.stats().transfers_served == 0
    finally:
        sender.close()


# --- options -------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "kv-node-1"])
def test_a_bind_off_loopback_without_a_token_is_refused(host):
    with pytest.raises(
        ValueError, match=re.escape(f"bind_host '{host}' is not a loopback address")
    ):
        TransportOptions(bind_host=host)
    assert TransportOptions(bind_host=host, token="t").bind_host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_binds_may_go_without_a_token(host):
    assert TransportOptions(bind_host=host).token == ""


def test_the_cluster_config_binds_off_loopback_only_with_the_token_it_draws():
    config = ClusterConfig.from_dict({"transport": {"bind_host": "0.0.0.0"}})  # validates
    with pytest.raises(ConfigError, match=re.escape("bind_host '0.0.0.0'")):
        config.kv_transport_options()  # no worker may get these without a token
    drawn = config.replace(transport={"token": "drawn"}).kv_transport_options()
    assert (drawn.bind_host, drawn.token) == ("0.0.0.0", "drawn")


def test_tls_options_validate(certificates, tmp_path):
    cert, key, ca = certificates["ip_cert"], certificates["ip_key"], certificates["ca"]
    bad = {
        "tls_certfile and tls_keyfile go together": dict(tls_certfile=cert),
        "tls_keyfile": dict(tls_keyfile=key),
        "is not a file": dict(tls_certfile=cert, tls_keyfile=str(tmp_path / "missing.key")),
        "without tls_certfile": dict(tls_ca_file=ca),
    }
    for message, fields in bad.items():
        with pytest.raises(ValueError, match=message):
            TransportOptions(**fields)
    assert TransportOptions(tls_certfile=cert, tls_keyfile=key, tls_ca_file=ca).tls_enabled


# --- collective: store and pair devices ---------------------------------------------


def listening_addresses(port: int) -> set[str]:
    connections = psutil.Process().net_connections(kind="inet")
    return {c.laddr.ip for c in connections if c.status == "LISTEN" and c.laddr.port == port}


def test_the_collective_store_listens_on_bind_host_only():
    sender = make_sender("collective", "prefill-0", random_pool(), OPTIONS)
    try:
        _, store_port = sender.endpoint().collective.store
        assert listening_addresses(store_port) == {"127.0.0.1"}
    finally:
        sender.close()


def test_gloo_pair_devices_bind_the_address_peers_dial(monkeypatch):
    """Both ends of a pair hand gloo `dial_host` (here `localhost`, while the servers
    bind 127.0.0.1), never `bind_host`, which may be 0.0.0.0 that no peer can dial."""
    hosts = []
    make_pair_group = collective.make_pair_group

    def recorded(store, prefix, rank, host, device, timeout_s):
        hosts.append(host)
        return make_pair_group(store, prefix, rank, host, device, timeout_s)

    monkeypatch.setattr(collective, "make_pair_group", recorded)
    options = replace(OPTIONS, advertise_host="localhost")
    source = random_pool(seed=1)
    sender = make_sender("collective", "prefill-0", source, options)
    try:
        result, pool = fetch_with("collective", sender, options, "r")
        assert result.ok, result.message
        assert torch.equal(pool.read_blocks(DST), source.read_blocks(BLOCKS))
        assert hosts == ["localhost", "localhost"]
    finally:
        sender.close()


# --- cancelled fetches ---------------------------------------------------------------


def test_cancelled_fetch_ids_age_out_and_are_bounded_in_number():
    now = [0.0]
    cancelled = _Cancellations(ttl_s=10.0, max_ids=3, clock=lambda: now[0])
    for request_id in "abcde":
        cancelled.cancel(request_id)
    assert len(cancelled) == 3
    assert "a" not in cancelled and "b" not in cancelled and "e" in cancelled
    now[0] = 9.0
    assert "c" in cancelled
    now[0] = 10.5
    assert "e" not in cancelled
    assert len(cancelled) == 0


def test_cancelled_fetch_ids_stay_bounded_by_default():
    cancelled = _Cancellations()
    for i in range(CANCEL_MEMORY_IDS + 500):
        cancelled.cancel(f"r{i}")
    assert len(cancelled) == CANCEL_MEMORY_IDS
    assert "r0" not in cancelled and f"r{CANCEL_MEMORY_IDS + 499}" in cancelled


def test_logging_of_refused_connections_is_quiet(control_server, caplog):
    """An attacker's connections past the bound cost a debug line, not a warning each."""
    caplog.set_level(logging.DEBUG, logger="kv_transfer.control")
    server = control_server(max_connections=1)
    held = ControlConnection("127.0.0.1", server.port, OPTIONS, 5)
    assert held.call({"op": "hold"}) == {"ok": True, "op": "hold"}
    extra = raw_connection(server)
    assert closed_by_server(extra)
    extra.close()
    held.close()
    refused = [r for r in caplog.records if "all slots busy" in r.getMessage()]
    assert [r.levelno for r in refused] == [logging.DEBUG]
