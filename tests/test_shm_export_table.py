"""The shm sender's export table: after one `begin` that a sender answered, a receiver
reads each export's lease in shared memory instead of sending a message, and still
refuses an export released before or during its copy."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from kv_transfer import (
    FailureReason,
    FaultOptions,
    TransportOptions,
    make_receiver,
    make_sender,
)
from kv_transfer.transports import shm
from kv_transfer.transports.shm import ShmReceiver, ShmServer, remove_stale_files
from tests.kv_transfer_peer import LAYOUT, random_pool

BLOCKS = [1, 2, 3]
DST = [7, 8, 9]


class Pair:
    """An in-process shm sender and receiver, with the `begin` messages counted."""

    def __init__(self, tmp_path, monkeypatch, **overrides):
        self.begins = 0
        original = ShmServer._begin

        def counted(server, conn, request_id, nbytes):
            self.begins += 1
            original(server, conn, request_id, nbytes)

        monkeypatch.setattr(ShmServer, "_begin", counted)
        options = TransportOptions(token="t", timeout_s=5.0, shm_dir=str(tmp_path), **overrides)
        self.source, self.dest = random_pool(seed=1), random_pool(seed=2)
        self.sender = make_sender("shm", "prefill-0", self.source, options)
        self.receiver = make_receiver("shm", "decode-0", self.dest, options)

    def fetch(self, request_id: str):
        ticket = self.sender.export(request_id, BLOCKS, 24, "decode-0")
        return ticket, self.receiver.fetch(ticket, DST, timeout_s=5)

    def accepted(self) -> None:
        """The first fetch from a sender sends `begin` (its token is checked there)."""
        _, result = self.fetch("first")
        assert result.ok, result.message
        self.sender.ack("first")
        assert self.begins == 1

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def pair(tmp_path, monkeypatch):
    made = Pair(tmp_path, monkeypatch)
    yield made
    made.close()


def test_a_fetch_from_an_accepted_sender_sends_no_begin_and_is_counted_at_ack(pair):
    pair.accepted()
    _, result = pair.fetch("second")

    assert result.ok, result.message
    assert pair.begins == 1
    assert torch.equal(pair.dest.kv[DST], pair.source.kv[BLOCKS])
    assert pair.sender.stats().transfers_served == 1  # the sender learns of it at release
    pair.sender.ack("second")
    stats = pair.sender.stats()
    assert (stats.transfers_served, stats.bytes_sent) == (2, 2 * 3 * LAYOUT.block_nbytes)


def test_an_export_released_before_its_copy_is_refused_and_nothing_is_written(pair):
    pair.accepted()
    ticket = pair.sender.export("gone", BLOCKS, 24, "decode-0")
    pair.sender.abort("gone")
    before = pair.dest.kv.clone()

    result = pair.receiver.fetch(ticket, DST, timeout_s=5)

    assert result.reason == FailureReason.UNKNOWN_REQUEST, result
    assert torch.equal(pair.dest.kv, before)
    assert pair.begins == 1


def test_an_export_released_during_its_copy_is_refused(pair, monkeypatch):
    pair.accepted()
    copy = ShmReceiver._copy

    def released_midway(receiver, ticket, *args, **kwargs):
        pair.sender.abort(ticket.request_id)  # the lease ends as the bytes move
        copy(receiver, ticket, *args, **kwargs)

    monkeypatch.setattr(ShmReceiver, "_copy", released_midway)
    _, result = pair.fetch("aborted")

    assert result.reason == FailureReason.UNKNOWN_REQUEST, result
    assert "during the copy" in result.message


def test_a_lease_near_its_end_is_extended_before_the_copy(tmp_path, monkeypatch):
    pair = Pair(tmp_path, monkeypatch, lease_ttl_s=3.0)
    try:
        pair.accepted()
        ticket = pair.sender.export("late", BLOCKS, 24, "decode-0")
        time.sleep(2.1)  # less than a third of the lease is left
        beats = pair.sender.stats().heartbeats

        result = pair.receiver.fetch(ticket, DST, timeout_s=5)

        assert result.ok, result.message
        assert pair.sender.stats().heartbeats == beats + 1
        assert pair.sender.registry.get("late").lease_expires_at > time.monotonic() + 2.0
        assert pair.begins == 1
    finally:
        pair.close()


@pytest.mark.parametrize("mode", ["drop", "stall", "kill"])
def test_a_sender_whose_faults_strike_in_begin_publishes_no_table(tmp_path, mode):
    options = TransportOptions(token="t", shm_dir=str(tmp_path), faults=FaultOptions(mode=mode))
    faulty = make_sender("shm", "prefill-0", random_pool(seed=1), options)
    plain = make_sender(
        "shm", "prefill-1", random_pool(seed=1), replace(options, faults=FaultOptions())
    )
    try:
        assert faulty.endpoint().shm.table is None
        assert plain.endpoint().shm.table.blocks == plain.pool.num_blocks
    finally:
        faulty.close()
        plain.close()
    assert not list(tmp_path.iterdir())  # both pool files and tables unlinked


def test_files_of_dead_senders_are_removed_and_the_living_kept(tmp_path):
    dead = 2**22 + 12345  # above the largest pid_max: no such process
    for suffix in (shm.POOL_SUFFIX, shm.TABLE_SUFFIX):
        (tmp_path / f"{shm.FILE_PREFIX}w-{dead}{suffix}").write_bytes(b"")
        (tmp_path / f"{shm.FILE_PREFIX}w-1{suffix}").write_bytes(b"")  # init lives
    remove_stale_files(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{shm.FILE_PREFIX}w-1{shm.POOL_SUFFIX}",
        f"{shm.FILE_PREFIX}w-1{shm.TABLE_SUFFIX}",
    ]
