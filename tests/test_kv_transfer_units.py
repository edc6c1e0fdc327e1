"""In-process checks of the pieces under the transports: leases, integrity, planning,
shaping, options, refusals (layout, token, unknown request)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.block_manager import BlockAllocator
from engine.kv_cache import KVLayout
from kv_transfer import (
    ExportTicket,
    FailureReason,
    FaultOptions,
    KVTransferError,
    TransferState,
    TransportOptions,
    make_receiver,
    make_sender,
)
from kv_transfer.blockio import copy_pieces_parallel, flat_bytes, plan_pieces, stripes
from kv_transfer.integrity import checksum
from kv_transfer.ownership import ExportRegistry
from tests.kv_transfer_peer import LAYOUT, random_pool

OPTIONS = TransportOptions(token="secret", timeout_s=5.0)


# --- ownership ---------------------------------------------------------------------


def test_ack_releases_blocks_exactly_once():
    registry = ExportRegistry("p0", lease_ttl_s=10)
    registry.add("r1", [3, 4], 16, "d0", [0, 0])
    assert registry.ack("r1")
    assert not registry.ack("r1")  # late or duplicate ack
    assert not registry.abort("r1")
    assert registry.poll_released() == [[3, 4]]
    assert registry.poll_released() == []
    stats = registry.stats()
    assert (stats.exports, stats.acks, stats.aborts, stats.pinned_blocks) == (1, 1, 0, 0)
    registry.close()


def test_an_export_counts_as_pulled_only_after_a_transfer_succeeded():
    registry = ExportRegistry("p0", lease_ttl_s=10)
    for rid in ("pulled", "failed", "waiting"):
        registry.add(rid, [len(rid)], 8, "d0", [0])
    registry.begin_transfer("pulled")
    registry.begin_transfer("failed")
    registry.end_transfer("pulled", 100)
    registry.end_transfer("failed", 0, FailureReason.CHECKSUM)
    assert sorted(registry.unserved_request_ids()) == ["failed", "waiting"]
    assert sorted(registry.request_ids()) == ["failed", "pulled", "waiting"]  # all pinned
    registry.close()


def test_lease_expires_without_ack_and_heartbeats_keep_it():
    registry = ExportRegistry("p0", lease_ttl_s=0.2, reap_interval_s=0.02)
    registry.add("kept", [1], 8, "d0", [0])
    registry.add("forgotten", [2], 8, "d0", [0])
    # 1. heartbeats on `kept` for three TTLs; `forgotten` gets none
    for _ in range(12):
        assert registry.heartbeat("kept")
        time.sleep(0.05)
    assert registry.get("kept").state == TransferState.PENDING
    assert registry.get("forgotten") is None
    # 2. the reaper released `forgotten` once, and an ack after expiry changes nothing
    assert registry.poll_released() == [[2]]
    assert not registry.ack("forgotten")
    # 3. silence: `kept` expires too
    time.sleep(0.35)
    assert registry.poll_released() == [[1]]
    assert registry.stats().expiries == 2
    registry.close()


def test_transfer_state_is_ordered():
    assert TransferState.FAILED < TransferState.PENDING < TransferState.TRANSFERRING
    assert TransferState.TRANSFERRING < TransferState.DONE


# --- integrity and planning --------------------------------------------------------


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])
def test_checksum_catches_a_flipped_bit_and_swapped_rows(algo):
    data = np.random.default_rng(0).integers(0, 255, 64 << 10, dtype=np.uint8)
    reference = checksum(data, algo)
    flipped = data.copy()
    flipped[12345] ^= 1
    swapped = data.copy()
    swapped[:4096], swapped[4096:8192] = data[4096:8192], data[:4096]
    assert checksum(flipped, algo) != reference
    assert checksum(swapped, algo) != reference
    assert checksum(data.copy(), algo) == reference


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])
@pytest.mark.parametrize("corrupt", [False, True])
@pytest.mark.parametrize("blocks_per_piece", [2, 1.5, 0.3])
@pytest.mark.parametrize("native", [True, False])
def test_copy_piece_sums_blocks_in_steps_exactly_as_whole_blocks(
    monkeypatch, algo, corrupt, blocks_per_piece, native
):
    """Blocks copied and summed a step at a time (here 1000 B: four whole steps and a
    short one per 4 KiB block), or whole blocks in one native pass where the piece
    holds them, in pieces of whole blocks or cutting through them, verify against the
    sender's one-shot sums; a piece flipped by fault injection fails exactly its first
    block."""
    from types import SimpleNamespace

    from kv_transfer import integrity
    from kv_transfer.integrity import BlockVerifier, block_checksums

    monkeypatch.setattr(integrity, "CACHE_STEP", 1000)
    if not native:
        monkeypatch.setattr(integrity, "_fused_copy_hash", lambda: None)
    source, dest = random_pool(seed=3), random_pool(seed=4)
    src_ids, dst_ids = [3, 4, 5], [10, 11, 12]
    ticket = SimpleNamespace(
        checksums=block_checksums(source.kv, src_ids, algo),
        checksum_algo=algo,
        request_id="r",
        sender_id="prefill-0",
    )
    verifier = BlockVerifier(dest.kv, dst_ids, ticket)
    src_all, dst_all = flat_bytes(source.kv).numpy(), flat_bytes(dest.kv).numpy()
    chunk = int(blocks_per_piece * LAYOUT.block_nbytes)
    for piece in plan_pieces(src_ids, dst_ids, LAYOUT.block_nbytes, chunk):
        verifier.copy_piece(
            src_all[piece.src : piece.src + piece.nbytes],
            dst_all[piece.dst : piece.dst + piece.nbytes],
            piece.offset,
            corrupt and piece.offset == 0,
        )
    assert verifier.checked == [True, True, True]
    if corrupt:
        with pytest.raises(KVTransferError, match=r"1 of 3 blocks.*positions \[0\]"):
            verifier.finish()
    else:
        verifier.finish()
        assert torch.equal(dest.kv[dst_ids], source.kv[src_ids])


def test_native_copy_hash_fails_a_block_changed_after_its_export():
    """A sender block rewritten after the export (reused under the receiver) fails its
    checksum on the native path too, and only that block."""
    from types import SimpleNamespace

    from kv_transfer.integrity import BlockVerifier, block_checksums

    source, dest = random_pool(seed=5), random_pool(seed=6)
    src_ids, dst_ids = [3, 4, 5], [10, 11, 12]
    ticket = SimpleNamespace(
        checksums=block_checksums(source.kv, src_ids, "xxh3_64"),
        checksum_algo="xxh3_64",
        request_id="r",
        sender_id="prefill-0",
    )
    source.kv[4].view(-1)[100] += 1.0
    verifier = BlockVerifier(dest.kv, dst_ids, ticket)
    src_all, dst_all = flat_bytes(source.kv).numpy(), flat_bytes(dest.kv).numpy()
    size = LAYOUT.block_nbytes
    verifier.copy_piece(src_all[3 * size : 6 * size], dst_all[10 * size : 13 * size], 0, False)
    assert verifier.checked == [True, True, True]
    with pytest.raises(KVTransferError, match=r"1 of 3 blocks.*positions \[1\]"):
        verifier.finish()


XXH3_LENGTHS = [
    1,
    3,
    4,
    8,
    9,
    16,
    17,
    128,
    129,
    240,
    241,
    255,
    256,
    257,
    319,
    320,
    1023,
    1024,
    1025,
    1087,
    1088,
    1089,
    2047,
    2048,
    2049,
    4096 + 7,
    65536,
    737280,
    (1 << 20) + 63,
]
"""Lengths around each edge of XXH3's paths (1-3, 4-8, 9-16, 17-128, 129-240 bytes and
the long path), its 64-byte stripe and 1 KiB block, and checksum.c's 2 KiB copy step."""


def test_native_copy_hash_equals_the_xxhash_package_at_every_length_class():
    """engine/native/checksum.c: XXH3-64 (seed 0) of whole blocks, with or without their
    copy, equals the xxhash package's digest, the one senders compute and peers of every
    version agree on; the copy is exact, into a 64-byte aligned destination (blocks of
    whole 64-byte lines are then streamed around the cache) and into an unaligned one."""
    import xxhash

    from engine.native.ops import native_kernels

    kernels = native_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the receiver hashes in Python")
    rng = np.random.default_rng(7)
    lengths = [*XXH3_LENGTHS, *range(241, 1300, 17), 64 * 5, 1024 * 3]
    for length, dst_offset in itertools.product(lengths, [0, 8]):
        count = 3
        src = rng.integers(0, 256, count * length + 5, dtype=np.uint8)[5:]  # unaligned
        space = np.zeros(count * length + 128, dtype=np.uint8)
        start = -space.ctypes.data % 64 + dst_offset
        dst = space[start : start + count * length]
        copied, hashed = np.zeros(count, np.uint64), np.zeros(count, np.uint64)
        for destination, digests in ((dst.ctypes.data, copied), (None, hashed)):
            status = kernels.copy_xxh3_blocks(
                src=src.ctypes.data,
                dst=destination,
                block_nbytes=length,
                count=count,
                out=digests.ctypes.data,
            )
            assert status == 0
        expected = [
            xxhash.xxh3_64_intdigest(src[i * length : (i + 1) * length]) for i in range(count)
        ]
        assert copied.tolist() == expected == hashed.tolist(), (length, dst_offset)
        assert np.array_equal(dst, src)
        assert not space[:start].any() and not space[start + count * length :].any()


def test_native_copy_hash_refuses_an_empty_block_size():
    from engine.native.ops import native_kernels

    kernels = native_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the receiver hashes in Python")
    out = np.zeros(1, np.uint64)
    data = np.zeros(8, np.uint8)
    assert (
        kernels.copy_xxh3_blocks(
            src=data.ctypes.data, dst=None, block_nbytes=0, count=1, out=out.ctypes.data
        )
        == -1
    )


def test_plan_pieces_are_contiguous_on_both_sides():
    pieces = plan_pieces([4, 5, 6, 9], [0, 1, 7, 8], block_nbytes=100, chunk_bytes=150)
    assert [(p.src, p.dst, p.offset, p.nbytes) for p in pieces] == [
        (400, 0, 0, 150),
        (550, 150, 150, 50),
        (600, 700, 200, 100),
        (900, 800, 300, 100),
    ]


@pytest.mark.parametrize("failing_check", [None, 3])
def test_parallel_copy_is_exact_and_drains_before_a_failure_returns(failing_check):
    src = torch.randint(0, 255, (64 * 1024,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    pieces = plan_pieces(list(range(8)), [7, 6, 5, 4, 3, 2, 1, 0], 8192, 8192)
    running: list[int] = []
    verified: list[int] = []
    checks = itertools.count()

    def check():
        if failing_check is not None and next(checks) >= failing_check:
            raise TimeoutError("deadline")

    def land(src_piece, dst_piece, offset, corrupt):
        running.append(1)
        dst_piece[:] = src_piece
        if corrupt:
            dst_piece[0] = 255 - int(dst_piece[0])
        time.sleep(0.01)  # a slow copy still in flight when the other lane fails
        verified.append(offset)
        running.pop()

    def copy(corrupt=frozenset()):
        copy_pieces_parallel(
            flat_bytes(src), flat_bytes(dst), pieces, set(corrupt), check, land, pool, 2
        )

    with ThreadPoolExecutor(2) as pool:
        if failing_check is None:
            copy()
            assert sorted(verified) == [p.offset for p in pieces]
            assert torch.equal(dst.view(8, 8192).flip(0), src.view(8, 8192))
            copy(corrupt={5})  # receiver-side fault injection flips piece 5's first byte
            assert int(dst[2 * 8192]) == 255 - int(src[5 * 8192])
        else:
            with pytest.raises(TimeoutError):
                copy()
            assert not running  # nothing still writes into blocks the caller will free
            assert len(verified) <= failing_check < len(pieces)


def test_the_calling_threads_lane_keeps_the_heartbeats_going():
    """The caller copies a stripe itself; a transfer longer than a heartbeat period
    must still beat from there, not only once every lane is done."""
    src = torch.randint(0, 255, (8 * 4096,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    pieces = plan_pieces(list(range(8)), list(range(8)), 4096, 4096)
    beats: list[str] = []

    def land(src_piece, dst_piece, offset, corrupt):
        dst_piece[:] = src_piece

    with ThreadPoolExecutor(1) as pool:
        copy_pieces_parallel(
            flat_bytes(src), flat_bytes(dst), pieces, set(), lambda: None, land, pool, 2,
            tick=lambda: beats.append(threading.current_thread().name), tick_s=0.0,
        )  # fmt: skip
    assert torch.equal(dst, src)
    assert beats.count(threading.main_thread().name) >= 4  # one per piece of its stripe


def test_stripes_split_pieces_into_contiguous_lanes_of_equal_bytes():
    pieces = plan_pieces(list(range(10)), list(range(10)), 100, 100)
    assert stripes(pieces, 2) == [range(0, 5), range(5, 10)]
    assert stripes(pieces, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert stripes(pieces[:1], 4) == [range(0, 1)]


# --- refusals -------------------------------------------------------------------------


def _export(transport: str, options: TransportOptions, pool=None):
    pool = pool or random_pool()
    sender = make_sender(transport, "prefill-0", pool, options)
    return sender, sender.export("r", [1, 2, 3], 24, "decode-0")


def test_a_streaming_sender_extends_the_lease_every_third_of_it_not_per_piece():
    """`lease_beats`, what collective and gRPC servers call after each piece sent."""
    sender, _ = _export("local", replace(OPTIONS, lease_ttl_s=0.3))
    beat = sender.lease_beats("r")
    for _ in range(5):  # pieces sent right after begin_transfer extended the lease
        beat()
    assert sender.stats().heartbeats == 0
    time.sleep(0.12)
    beat()
    beat()
    assert sender.stats().heartbeats == 1
    sender.close()


def test_a_killed_sender_not_yet_reaped_counts_as_dead():
    """A SIGKILLed worker is a zombie until its parent reaps it; shm's dead-sender check
    must not take it for alive (the export would be recomputed for nothing)."""
    from kv_transfer.transports.shm import _pid_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while _pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _pid_alive(child.pid)
    assert child.poll() == 0  # it was a zombie until now: reaped only here
    assert _pid_alive(os.getpid())


def test_shm_maps_one_pool_file_per_sender_and_drops_a_restarted_senders_old_one(tmp_path):
    """A restarted sender exports from a new file; the receiver's mapping of the old one
    (all that kept a dead pool's pages allocated once its file was removed) goes."""
    import gc
    import weakref

    first, ticket = _export("shm", OPTIONS)
    receiver = make_receiver("shm", "decode-0", random_pool(seed=7), OPTIONS)
    try:
        assert receiver.fetch(ticket, [4, 5, 6], timeout_s=5).ok
        old_mapping = weakref.ref(receiver._maps["prefill-0"][1])
        # The restarted worker: same id, its pool in a file of its own.
        path = ticket.sender_endpoint.shm.path
        restarted = str(tmp_path / "pdserve-kv-prefill_0-restarted.kv")
        with open(path, "rb") as src, open(restarted, "wb") as dst:
            dst.write(src.read())
        endpoint = ticket.sender_endpoint
        again = replace(
            ticket, sender_endpoint=replace(endpoint, shm=replace(endpoint.shm, path=restarted))
        )
        receiver._mapped(again)
        gc.collect()
        assert list(receiver._maps) == ["prefill-0"]
        assert receiver._maps["prefill-0"][0] == restarted
        assert old_mapping() is None
    finally:
        receiver.close()
        first.close()


def test_layout_mismatch_is_refused_before_any_byte_moves():
    sender, ticket = _export("local", OPTIONS)
    other = replace(LAYOUT, head_dim=8)
    pool = random_pool(other, seed=3)
    before = pool.kv.clone()
    receiver = make_receiver("local", "decode-0", pool, OPTIONS)
    result = receiver.fetch(ticket, [0, 1, 2], timeout_s=2)
    assert result.state == TransferState.FAILED
    assert result.reason == FailureReason.LAYOUT_MISMATCH
    assert "head_dim" in result.message and "[request r]" in result.message
    assert torch.equal(pool.kv, before)
    assert receiver.stats().failures == {"layout_mismatch": 1}
    sender.close()


@pytest.mark.parametrize("transport", ["grpc", "shm", "collective"])
def test_wrong_cluster_token_is_refused(transport):
    sender, ticket = _export(transport, OPTIONS)
    pool = random_pool(seed=5)
    before = pool.kv.clone()
    receiver = make_receiver(transport, "decode-0", pool, replace(OPTIONS, token="guess"))
    result = receiver.fetch(ticket, [0, 1, 2], timeout_s=5)
    assert result.reason == FailureReason.UNAUTHORIZED, result
    assert not receiver.keepalive(ticket, timeout_s=2)
    assert torch.equal(pool.kv, before)
    assert sender.stats().transfers_served == 0
    receiver.close()
    sender.close()


def test_fetch_after_ack_is_unknown_and_the_export_stays_released():
    sender, ticket = _export("grpc", OPTIONS)
    receiver = make_receiver("grpc", "decode-0", random_pool(seed=6), OPTIONS)
    assert receiver.fetch(ticket, [0, 1, 2], timeout_s=5).ok
    sender.ack("r")
    again = receiver.fetch(ticket, [0, 1, 2], timeout_s=5)
    assert again.reason == FailureReason.UNKNOWN_REQUEST
    assert sender.poll_released() == [[1, 2, 3]]
    receiver.close()
    sender.close()


def test_ticket_round_trips_through_json():
    import json

    sender, ticket = _export("local", OPTIONS)
    assert ExportTicket.from_dict(json.loads(json.dumps(ticket.to_dict()))) == ticket
    sender.close()


@pytest.mark.parametrize(
    "bad",
    [
        dict(chunk_bytes=0),
        dict(bandwidth_bytes_per_s=0),
        dict(lease_ttl_s=0),
        dict(chunk_bytes=8 << 20, max_message_bytes=4 << 20),
        dict(checksum="md5"),
        dict(copy_threads=-1),
    ],
)
def test_options_validate(bad):
    with pytest.raises(ValueError):
        TransportOptions(**bad)


@pytest.mark.parametrize("bad", [dict(mode="explode"), dict(probability=2.0), dict(stall_s=-1)])
def test_fault_options_validate(bad):
    with pytest.raises(ValueError):
        FaultOptions(**bad)


def test_unknown_transport_name_is_refused():
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_sender("carrier-pigeon", "p", random_pool(), OPTIONS)


# --- shaping -------------------------------------------------------------------------


def test_bandwidth_cap_is_accurate_on_32_mib():
    layout = KVLayout("big", "float32", 1, 1, 512, 256)  # 1 MiB blocks (K and V)
    src, dst = random_pool(layout, 40), random_pool(layout, 40, seed=1)
    cap, latency = 128 << 20, 0.05
    options = replace(OPTIONS, bandwidth_bytes_per_s=cap, added_latency_s=latency)
    sender = make_sender("local", "shaped", src, options)
    ticket = sender.export("r", list(range(32)), 32 * 256, "d")
    result = make_receiver("local", "d", dst, options).fetch(ticket, list(range(32)), 10)
    assert result.ok
    expected = (32 << 20) / cap + latency
    assert abs(result.seconds - expected) / expected < 0.10, (result.seconds, expected)
    sender.close()


# --- proto ---------------------------------------------------------------------------


def test_generated_stubs_are_current(tmp_path):
    proto = Path(__file__).resolve().parent.parent / "proto"
    subprocess.run([sys.executable, "-m", "proto.generate", "--out", str(tmp_path)], check=True)
    for name in ("kv_transfer_pb2.py", "kv_transfer_pb2.pyi", "kv_transfer_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (proto / name).read_text(), (
            f"proto/{name} is stale: run proto/generate.sh"
        )


def test_allocator_free_matches_sender_release():
    """The worker loop pattern: free exactly what poll_released returns."""
    pool, allocator = random_pool(), BlockAllocator(64)
    sender = make_sender("local", "p", pool, OPTIONS)
    ids = allocator.allocate(3, "r")
    sender.export("r", ids, 24, "d")
    sender.abort("r")
    for released in sender.poll_released():
        allocator.free(released)
    allocator.assert_all_free()
    sender.close()


@pytest.mark.parametrize("mode", ["none", "corrupt"])
def test_shm_copy_lanes_move_exact_bytes_and_catch_a_corrupt_piece(tmp_path, mode):
    """shm on two copy lanes, many pieces: exact bytes, or CHECKSUM for a corrupted one."""
    block = LAYOUT.block_nbytes
    faults = FaultOptions(mode=mode, after_fraction=0.5)
    options = replace(
        OPTIONS, chunk_bytes=2 * block, copy_threads=2, shm_dir=str(tmp_path), faults=faults
    )
    src_pool = random_pool(seed=7)
    sender = make_sender("shm", "prefill-0", src_pool, options)
    ticket = sender.export("r", list(range(1, 17)), 128, "decode-0")
    dst_pool = random_pool(seed=8)
    receiver = make_receiver("shm", "decode-0", dst_pool, options)
    assert receiver.copy_lanes == 2
    dst = [40 - i for i in range(16)]  # reversed ids: every piece is one block

    result = receiver.fetch(ticket, dst, timeout_s=5)

    if mode == "none":
        assert result.ok, result.message
        assert torch.equal(dst_pool.kv[dst], src_pool.kv[1:17])
    else:
        assert result.reason == FailureReason.CHECKSUM
    receiver.close()
    sender.close()
