"""Injected faults between two real processes, for every networked transport.

Each scenario: the child (prefill side) exports under a faulty sender; this process
fetches and must get a typed failure within its timeout; the sender aborts (what the
worker does on a failure report) and both pools end free; then a fresh pair with no
fault moves the next request. A killed sender is a fresh child per case.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from engine.block_manager import BlockAllocator
from kv_transfer import (
    ExportTicket,
    FailureReason,
    FaultOptions,
    TransportOptions,
    make_receiver,
)
from tests.kv_transfer_peer import POOL_BLOCKS, Peer, random_pool

TRANSPORTS = ["shm", "collective", "grpc"]
TIMEOUT_S = 1.5
NUM_BLOCKS = 6
BASE = TransportOptions(chunk_bytes=4096, token="t0k3n", timeout_s=5.0, lease_ttl_s=10.0)

EXPECTED = {
    "drop": {FailureReason.DROPPED, FailureReason.TIMEOUT},
    "stall": {FailureReason.TIMEOUT},
    "corrupt": {FailureReason.CHECKSUM},
    "kill": {FailureReason.PEER_DIED},
}


@pytest.fixture(scope="module")
def shared_peer():
    peer = Peer()
    yield peer
    peer.close()


class DecodeSide:
    """This process as a decode worker: a pool, an allocator and receivers."""

    def __init__(self):
        self.pool = random_pool(seed=1)
        self.allocator = BlockAllocator(POOL_BLOCKS)

    def fetch(self, transport: str, options: TransportOptions, ticket: dict, name: str):
        receiver = make_receiver(transport, name, self.pool, options)
        dst = self.allocator.allocate(NUM_BLOCKS, name)
        try:
            return receiver.fetch(ExportTicket.from_dict(ticket), dst, TIMEOUT_S)
        finally:
            self.allocator.free(dst)  # success or not, this test keeps nothing
            receiver.close()


def _fresh_pair_succeeds(peer: Peer, decode: DecodeSide, transport: str, key: str) -> None:
    peer.call("open_sender", key, transport, BASE)
    ticket, _ = peer.call("export_random", key, f"{key}-next", NUM_BLOCKS)
    result = decode.fetch(transport, BASE, ticket, f"decode-{key}")
    assert result.ok and result.transport == transport, result.message
    peer.call("ack", key, f"{key}-next")
    assert peer.call("wait_all_free") == 0


def _faulty_fetch(peer: Peer, decode: DecodeSide, transport: str, fault: str, key: str):
    options = replace(BASE, faults=FaultOptions(mode=fault, stall_s=TIMEOUT_S + 1.5))
    peer.call("open_sender", key, transport, options)
    ticket, _ = peer.call("export_random", key, key, NUM_BLOCKS)
    start = time.monotonic()
    result = decode.fetch(transport, options, ticket, f"decode-{key}")
    return result, time.monotonic() - start


@pytest.mark.parametrize("fault", ["drop", "stall", "corrupt"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fault_fails_typed_within_timeout_and_leaks_nothing(shared_peer, transport, fault):
    decode, key = DecodeSide(), f"{transport}-{fault}"
    # 1. faulty transfer: typed failure, inside the timeout (plus the dead-peer probe)
    result, elapsed = _faulty_fetch(shared_peer, decode, transport, fault, key)
    assert not result.ok and result.reason in EXPECTED[fault], result
    assert result.transport == transport
    assert elapsed < TIMEOUT_S + 1.0
    # 2. the prefill worker aborts on the failure report; both pools end free
    shared_peer.call("abort", key, key)
    assert shared_peer.call("wait_all_free") == 0
    decode.allocator.assert_all_free()
    # 3. a fresh pair moves the next request
    _fresh_pair_succeeds(shared_peer, decode, transport, f"{key}-fresh")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sender_killed_mid_transfer(transport):
    """The sender dies as the transfer begins. Over the networked transports the bytes
    die with it (PEER_DIED); over shm its pool file outlives it, nothing writes it any
    more, and the receiver copies the export from it, verified by its checksums."""
    decode, key = DecodeSide(), f"{transport}-kill"
    doomed = Peer()
    try:
        result, elapsed = _faulty_fetch(doomed, decode, transport, "kill", key)
        doomed.process.join(5)
        assert doomed.process.exitcode == 17
    finally:
        doomed.close()
    if transport == "shm":
        assert result.ok and result.num_bytes == NUM_BLOCKS * decode.pool.layout.block_nbytes
    else:
        assert not result.ok and result.reason in EXPECTED["kill"], result
    assert elapsed < TIMEOUT_S + 1.0
    decode.allocator.assert_all_free()
    survivor = Peer()
    try:
        _fresh_pair_succeeds(survivor, decode, transport, f"{key}-fresh")
    finally:
        survivor.close()


def test_an_shm_export_waiting_for_blocks_outlives_its_dead_sender():
    """An import still waiting for decode blocks when its prefill worker dies keeps its
    export over shm (the receiver maps the dead pool file): keepalive says so and the
    later fetch moves the exact bytes, verified."""
    decode, key = DecodeSide(), "shm-outlived"
    doomed = Peer()
    receiver = make_receiver("shm", f"decode-{key}", decode.pool, BASE)
    dst = decode.allocator.allocate(NUM_BLOCKS, "first")
    try:
        doomed.call("open_sender", key, "shm", BASE)
        first, _ = doomed.call("export_random", key, f"{key}-first", NUM_BLOCKS)
        assert receiver.fetch(ExportTicket.from_dict(first), dst, TIMEOUT_S).ok  # maps the file
        waiting, sent = doomed.call("export_random", key, f"{key}-waiting", NUM_BLOCKS)
        doomed.process.kill()
        doomed.process.join(5)
        ticket = ExportTicket.from_dict(waiting)
        assert receiver.keepalive(ticket, timeout_s=2.0)
        result = receiver.fetch(ticket, dst, TIMEOUT_S)
        assert result.ok, result
        assert decode.pool.read_blocks(dst).numpy().tobytes() == sent
    finally:
        receiver.close()
        doomed.close()
        decode.allocator.free(dst)
    decode.allocator.assert_all_free()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lease_expires_without_ack_and_keepalive_holds_it(shared_peer, transport):
    decode, key = DecodeSide(), f"{transport}-lease"
    options = replace(BASE, lease_ttl_s=0.4)
    shared_peer.call("open_sender", key, transport, options)
    # 1. kept alive by the receiver past three TTLs, then fetched fine
    kept, _ = shared_peer.call("export_random", key, f"{key}-kept", NUM_BLOCKS)
    receiver = make_receiver(transport, f"decode-{key}", decode.pool, options)
    try:
        for _ in range(12):
            assert receiver.keepalive(ExportTicket.from_dict(kept), timeout_s=2.0)
            time.sleep(0.1)
    finally:
        receiver.close()
    assert decode.fetch(transport, options, kept, f"decode-{key}-2").ok
    # 2. never acked: the lease runs out and the sender gets its blocks back
    assert shared_peer.call("wait_all_free", 3.0) == 0
    stats = shared_peer.call("stats", key)
    assert (stats.exports, stats.expiries, stats.acks) == (1, 1, 0)
    assert stats.heartbeats >= 12
    # 3. a fetch after expiry is refused as unknown
    late = decode.fetch(transport, options, kept, f"decode-{key}-3")
    assert late.reason == FailureReason.UNKNOWN_REQUEST
