"""Streamed exports over every transport, without a cluster: a prefill side that exports
a request's blocks a segment at a time, and a receiver that pulls each segment on its
own into the blocks it reserved, skipping what its prefix cache holds."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_transfer import ExportTicket, TransportOptions, make_receiver, make_sender
from kv_transfer.base import StreamSegment
from kv_transfer.blockio import requested_blocks
from kv_transfer.control_messages import Fetch, parse_request
from kv_transfer.ownership import ExportRegistry
from tests.kv_transfer_peer import LAYOUT, random_pool

OPTIONS = TransportOptions(chunk_bytes=8 << 10, token="cluster-secret", timeout_s=20)
EXPORTED = [5, 9, 2, 3, 11, 12, 13]
"""Sender-side block ids of one prompt, in sequence order (runs and jumps on purpose)."""
SEGMENTS = [(0, 2), (2, 5), (5, 7)]
"""(first, stop) positions of each segment: what three prefill chunks completed."""


@pytest.mark.parametrize("transport", ["local", "shm", "collective", "grpc"])
@pytest.mark.parametrize("held", [0, 3])
def test_segments_land_one_by_one_and_the_export_is_released_once(transport, held):
    source, dest = random_pool(seed=1), random_pool(seed=2)
    sender = make_sender(transport, f"prefill-seg-{transport}-{held}", source, OPTIONS)
    receiver = make_receiver(transport, f"decode-seg-{transport}-{held}", dest, OPTIONS)
    dst = [40 + i for i in range(len(EXPORTED))]  # the receiver's blocks, by position
    untouched = dest.kv.clone()
    try:
        moved = 0
        for first, stop in SEGMENTS:
            final = stop == len(EXPORTED)
            tokens = stop * LAYOUT.block_size - (3 if final else 0)
            ticket = sender.export_segment("r", EXPORTED[first:stop], first, tokens, "d", final)
            ticket = ExportTicket.from_dict(ticket.to_dict())  # as it travels
            assert ticket.segment == StreamSegment(first, final)
            skip = max(0, held - first)
            if skip >= stop - first:
                continue  # the receiver's cache holds all of it: nothing moves
            part = ticket.tail(skip) if skip else ticket
            result = receiver.fetch(part, dst[first + skip : stop], timeout_s=20)
            assert result.ok, result.message
            moved += stop - first - skip
            # Landed before the next segment even exists: the pull does not wait for it.
            assert torch.equal(
                dest.kv[dst[first + skip : stop]], source.kv[EXPORTED[first + skip : stop]]
            )

        assert torch.equal(dest.kv[dst[held:]], source.kv[EXPORTED[held:]])
        assert torch.equal(dest.kv[dst[:held]], untouched[dst[:held]])  # held: not written
        assert receiver.stats().bytes_received == moved * LAYOUT.block_nbytes
        whole = sender.whole_ticket("r")
        assert whole.block_ids == EXPORTED and whole.segment is None
        assert whole.num_tokens == len(EXPORTED) * LAYOUT.block_size - 3
        assert len(whole.checksums) == len(EXPORTED)
        sender.ack("r")
        assert sender.poll_released() == [EXPORTED]  # the whole export, exactly once
        sender.ack("r")
        assert sender.poll_released() == []
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("transport", ["local", "shm", "collective", "grpc"])
def test_an_aborted_stream_fails_the_pull_of_its_segment_and_releases_what_it_held(transport):
    source, dest = random_pool(seed=1), random_pool(seed=2)
    sender = make_sender(transport, f"prefill-cut-{transport}", source, OPTIONS)
    receiver = make_receiver(transport, f"decode-cut-{transport}", dest, OPTIONS)
    try:
        first = sender.export_segment("r", EXPORTED[:2], 0, 16, "d")
        second = sender.export_segment("r", EXPORTED[2:5], 2, 40, "d")
        assert receiver.fetch(first, [40, 41], timeout_s=20).ok
        sender.abort("r")  # the request was cancelled mid-stream
        result = receiver.fetch(second, [42, 43, 44], timeout_s=20)
        assert not result.ok and result.reason.value == "unknown_request", result
        assert sender.poll_released() == [EXPORTED[:5]]
        with pytest.raises(KeyError):
            sender.whole_ticket("r")
    finally:
        receiver.close()
        sender.close()


def test_segments_must_come_in_order_and_stop_at_the_final_one():
    registry = ExportRegistry("p", lease_ttl_s=30)
    try:
        registry.add_segment("r", [1, 2], 0, 16, "d", [0, 0], final=False)
        with pytest.raises(ValueError):
            registry.add_segment("r", [3], 3, 24, "d", [0], final=False)  # a gap
        registry.add_segment("r", [3], 2, 20, "d", [0], final=True)
        with pytest.raises(ValueError):
            registry.add_segment("r", [4], 3, 28, "d", [0], final=True)  # after the final
        with pytest.raises(ValueError):
            registry.add_segment("x", [4], 1, 8, "d", [0], final=True)  # no first segment
        record = registry.get("r")
        assert record.block_ids == [1, 2, 3] and record.complete and record.num_tokens == 20
    finally:
        registry.close()


def test_a_waiting_pusher_wakes_when_the_next_segment_lands_or_the_export_goes():
    registry = ExportRegistry("p", lease_ttl_s=30)
    try:
        registry.add_segment("r", [1, 2], 0, 16, "d", [0, 0], final=False)
        assert len(registry.wait_for_blocks("r", 0, 5).block_ids) == 2  # already there
        woke: list = []
        waiter = threading.Thread(target=lambda: woke.append(registry.wait_for_blocks("r", 2, 5)))
        waiter.start()
        time.sleep(0.05)
        registry.add_segment("r", [3], 2, 20, "d", [0], final=True)
        waiter.join(2)
        assert woke and woke[0].block_ids == [1, 2, 3] and woke[0].complete
        waiter = threading.Thread(target=lambda: woke.append(registry.wait_for_blocks("q", 0, 5)))
        registry.add_segment("q", [7], 0, 8, "d", [0], final=False)
        waiter.start()
        registry.abort("q")
        waiter.join(2)
        assert woke[-1] is None or woke[-1].block_ids == [7]
        assert registry.wait_for_blocks("q", 0, 5) is None
    finally:
        registry.close()


def test_a_segment_pull_names_its_blocks_and_a_whole_pull_is_unchanged():
    export = [5, 9, 2, 3]
    assert requested_blocks(export, 2, first_block=1) == [9, 2]
    assert requested_blocks(export, 2, first_block=3) is None  # not exported (yet)
    assert requested_blocks(export, 2) == [2, 3]  # the tail, as before
    whole = Fetch("r", [1, 2]).to_json()
    assert whole == {"op": "fetch", "request_id": "r", "dst_block_ids": [1, 2]}
    assert parse_request({**whole, "first_block": 4}) == Fetch("r", [1, 2], 4)


# --- push: the receiver's standing transfer, opened before the export exists -----------

PUSH_TRANSPORTS = ["local", "shm", "collective", "grpc"]


def follow_in_thread(receiver, sender, request_id, first, dst, timeout_s=20):
    """Start `receiver.follow` on a thread; returns (thread, results, segments seen)."""
    results, landed = [], []

    def on_segment(ticket, arrived, done, nbytes):
        landed.append((ticket.first_block, len(ticket.block_ids), ticket.segment.final, nbytes))

    def run():
        source = sender.push_source()
        results.append(receiver.follow(source, request_id, first, dst, timeout_s, on_segment))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results, landed


@pytest.mark.parametrize("transport", PUSH_TRANSPORTS)
@pytest.mark.parametrize("held", [0, 3])
def test_pushed_segments_land_as_they_are_exported(transport, held):
    source, dest = random_pool(seed=1), random_pool(seed=2)
    sender = make_sender(transport, f"prefill-push-{transport}-{held}", source, OPTIONS)
    receiver = make_receiver(transport, f"decode-push-{transport}-{held}", dest, OPTIONS)
    dst = [40 + i for i in range(len(EXPORTED))]
    untouched = dest.kv.clone()
    try:
        # 1. The receiver follows before anything is exported (the prompt is queued).
        thread, results, landed = follow_in_thread(receiver, sender, "r", held, dst[held:])
        time.sleep(0.3)  # past a keepalive: the standing transfer waits, it does not fail
        # 2. Segments come one by one; each reaches the receiver without being asked for.
        for first, stop in SEGMENTS:
            final = stop == len(EXPORTED)
            tokens = stop * LAYOUT.block_size - (3 if final else 0)
            sender.export_segment("r", EXPORTED[first:stop], first, tokens, "d", final)
            if not final and stop > held:
                _wait_until(
                    lambda stop=stop: landed and sum(n for _, n, _, _ in landed) >= stop - held
                )
        thread.join(20)
        # 3. Every block from `held` on landed, verified; the held ones were not written.
        assert results and results[0].ok, results
        assert results[0].num_bytes == (len(EXPORTED) - held) * LAYOUT.block_nbytes
        assert torch.equal(dest.kv[dst[held:]], source.kv[EXPORTED[held:]])
        assert torch.equal(dest.kv[dst[:held]], untouched[dst[:held]])
        assert landed[0][0] == held and landed[-1][2]  # from the first block needed; final last
        positions = [first for first, *_ in landed]
        assert positions == sorted(positions)
        sender.ack("r")
        assert sender.poll_released() == [EXPORTED]
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("transport", PUSH_TRANSPORTS)
def test_a_standing_transfer_ends_on_cancel_and_on_an_aborted_export(transport):
    source, dest = random_pool(seed=1), random_pool(seed=2)
    sender = make_sender(transport, f"prefill-pushcut-{transport}", source, OPTIONS)
    receiver = make_receiver(transport, f"decode-pushcut-{transport}", dest, OPTIONS)
    try:
        thread, results, _ = follow_in_thread(receiver, sender, "c", 0, [40, 41, 42])
        time.sleep(0.3)
        started = time.monotonic()
        receiver.cancel("c")  # the request was aborted while its prompt was queued
        thread.join(5)
        assert results and results[0].reason.value == "cancelled", results
        assert time.monotonic() - started < 2  # at the next keepalive, not the timeout
        thread, results, landed = follow_in_thread(receiver, sender, "a", 0, [40, 41, 42])
        sender.export_segment("a", EXPORTED[:2], 0, 16, "d")
        _wait_until(lambda: landed)
        sender.abort("a")  # cancelled on the prefill side mid-stream
        thread.join(5)
        assert results and results[0].reason.value == "unknown_request", results
        assert landed == [(0, 2, False, 2 * LAYOUT.block_nbytes)]  # what came first counts
        assert sender.poll_released() == [EXPORTED[:2]]
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("transport", PUSH_TRANSPORTS)
def test_a_standing_transfer_waits_for_a_slow_prefill_past_its_timeout(transport):
    """The sender's `Waiting` notes keep it open: a prompt may be queued or prefill for
    longer than one message's timeout."""
    source, dest = random_pool(seed=1), random_pool(seed=2)
    sender = make_sender(transport, f"prefill-slow-{transport}", source, OPTIONS)
    receiver = make_receiver(transport, f"decode-slow-{transport}", dest, OPTIONS)
    try:
        thread, results, _ = follow_in_thread(receiver, sender, "s", 0, [40, 41], timeout_s=0.4)
        time.sleep(1.0)  # 2.5 timeouts with nothing exported
        sender.export_segment("s", EXPORTED[:2], 0, 12, "d", final=True)
        thread.join(10)
        assert results and results[0].ok, results
        assert torch.equal(dest.kv[[40, 41]], source.kv[EXPORTED[:2]])
    finally:
        receiver.close()
        sender.close()


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
