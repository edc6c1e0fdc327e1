"""Optional transfer peers (bench/transfer_peers.py): each installed one moves 2 MiB
from a spawned sender into this process and the bytes are the sender's. Skipped where a
peer is not installed (CI: they are not a dependency; `make peers` installs them)."""

from __future__ import annotations

import pytest

from bench.transfer_peers import MIB, installed_peers, measure_peer, peer_problem

SIZE = 2 * MIB


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_peer_moves_2mib_and_the_bytes_are_the_senders(name):
    if name not in installed_peers():
        pytest.skip(f"{name} is not installed (make peers)")
    problem = peer_problem(name)
    assert problem is None, f"{name} is installed but cannot start: {problem}"
    # measure_peer raises unless the received buffer hashes to the sender's data.
    assert measure_peer(name, SIZE, repeats=1) > 0


def test_a_transfer_that_moves_nothing_is_caught(monkeypatch):
    import bench.transfer_peers as peers

    if not installed_peers():
        pytest.skip("no peer installed (make peers)")
    name = installed_peers()[0]
    original = peers._READERS[name]

    def reader_that_drops_the_bytes(buf, offer):
        read, close = original(buf, offer)

        def dropped() -> float:
            seconds = read()
            buf.fill(0)
            return seconds

        return dropped, close

    monkeypatch.setitem(peers._READERS, name, reader_that_drops_the_bytes)
    with pytest.raises(RuntimeError, match="differ from the sender's"):
        measure_peer(name, SIZE, repeats=1)
