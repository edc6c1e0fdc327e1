"""The data path of device pools, proven on CPU tensors where its logic runs there: the
device checksum (`wsum64`) against its plain-integer definition and what it catches, a
whole transfer verified with it end to end (receipt included), the transfer stream's
no-op on CPU pools, and the NCCL failure policy set before every NCCL pair group. The
GPU runs the same on CUDA tensors and times a transfer under decode
(tests/test_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from engine.kv_cache import KVLayout
from kv_transfer import (
    FailureReason,
    FaultOptions,
    TransportOptions,
    device_checksum,
    make_receiver,
    make_sender,
)
from kv_transfer import sender as sender_module
from kv_transfer.device_checksum import (
    WSUM64,
    block_words,
    checksum_algo_for,
    wsum64,
    wsum64_reference,
)
from kv_transfer.integrity import BlockVerifier, block_checksums
from kv_transfer.transfer_stream import TransferStream
from tests.kv_transfer_peer import LAYOUT, random_pool

OPTIONS = TransportOptions(token="secret", timeout_s=5.0, chunk_bytes=1536)
"""Pieces of 1.5 blocks: some cut through a block."""


def _bytes(pool, block: int) -> bytes:
    return pool.kv[block].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_wsum64_is_its_definition_on_every_dtype(dtype):
    layout = KVLayout("t", dtype, num_layers=2, num_kv_heads=2, head_dim=16, block_size=8)
    pool = random_pool(layout, num_blocks=9, seed=1)
    ids = [7, 0, 3, 3]
    assert wsum64(pool.kv, ids) == [wsum64_reference(_bytes(pool, b)) for b in ids]
    assert block_words(pool.kv).dtype == torch.int32


def test_wsum64_of_blocks_not_a_multiple_of_four_bytes_sums_bytes():
    kv = torch.randint(0, 256, (4, 3, 7), dtype=torch.uint8, generator=torch.Generator())
    assert block_words(kv).shape == (4, 21) and block_words(kv).dtype == torch.uint8
    assert wsum64(kv, [2, 1]) == [wsum64_reference(kv[b].numpy().tobytes()) for b in (2, 1)]


def test_wsum64_in_groups_equals_one_group(monkeypatch):
    pool = random_pool(seed=2)
    ids = list(range(0, 40, 3))
    whole = wsum64(pool.kv, ids)
    monkeypatch.setattr(device_checksum, "GROUP_BYTES", 1)  # one block per reduction
    assert wsum64(pool.kv, ids) == whole
    assert wsum64(pool.kv, []) == []


def test_wsum64_catches_a_flipped_bit_and_swapped_words():
    pool = random_pool(seed=3)
    reference = wsum64(pool.kv, [5])[0]
    words = block_words(pool.kv)[5]
    flipped = pool.kv.clone()
    block_words(flipped)[5, 100] ^= 1 << 17
    swapped = pool.kv.clone()
    block_words(swapped)[5, 10], block_words(swapped)[5, 900] = words[900], words[10]
    assert words[10] != words[900]
    assert wsum64(flipped, [5])[0] != reference
    assert wsum64(swapped, [5])[0] != reference
    assert wsum64(pool.kv.clone(), [5])[0] == reference
    assert 0 <= reference < 1 << 64
    weights = device_checksum.position_weights(words.shape[0], torch.device("cpu"))
    assert bool((weights % 2 != 0).all())  # odd: any one changed word changes the sum
    neighbours = pool.kv.clone()
    row = block_words(neighbours)[5]
    row[0], row[1] = words[1], words[0]
    assert words[0] != words[1] and wsum64(neighbours, [5])[0] != reference


def test_device_pools_checksum_on_the_device_and_cpu_pools_as_configured():
    assert checksum_algo_for(torch.device("cpu"), "xxh3_64") == "xxh3_64"
    assert checksum_algo_for(torch.device("cpu"), "crc32") == "crc32"
    assert checksum_algo_for(torch.device("cuda", 1), "xxh3_64") == WSUM64


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_wsum64_verifier_sums_every_block_at_finish(corrupt):
    """Pieces land (whole blocks and cut ones alike) with no per-piece sum; `finish`
    sums every destination block in one go and names the one that differs."""
    from types import SimpleNamespace

    from kv_transfer.blockio import flat_bytes, plan_pieces

    source, dest = random_pool(seed=4), random_pool(seed=5)
    src_ids, dst_ids = [3, 4, 5], [10, 11, 12]
    ticket = SimpleNamespace(
        checksums=block_checksums(source.kv, src_ids, WSUM64),
        checksum_algo=WSUM64,
        request_id="r",
        sender_id="prefill-0",
    )
    verifier = BlockVerifier(dest.kv, dst_ids, ticket)
    src_all, dst_all = flat_bytes(source.kv).numpy(), flat_bytes(dest.kv).numpy()
    pieces = plan_pieces(src_ids, dst_ids, LAYOUT.block_nbytes, OPTIONS.chunk_bytes)
    assert [p.offset for p in pieces] == list(range(0, 3 * LAYOUT.block_nbytes, 1536))
    for piece in pieces:
        verifier.copy_piece(
            src_all[piece.src : piece.src + piece.nbytes],
            dst_all[piece.dst : piece.dst + piece.nbytes],
            piece.offset,
            corrupt and piece.offset == 4608,  # inside the second block
        )
        verifier.landed(piece.offset + piece.nbytes)
        if piece is not pieces[-1]:  # nothing summed until the stream is whole
            assert verifier.checked == [False, False, False]
    if corrupt:
        with pytest.raises(Exception, match=r"1 of 3 blocks.*positions \[1\]"):
            verifier.finish()
    else:
        verifier.finish()
        assert torch.equal(dest.kv[dst_ids], source.kv[src_ids])


@pytest.fixture
def wsum64_exports(monkeypatch):
    """Senders checksum as a device pool's would, on these CPU pools."""
    monkeypatch.setattr(sender_module, "checksum_algo_for", lambda device, configured: WSUM64)


@pytest.mark.parametrize("fault", ["none", "corrupt"])
def test_a_transfer_verified_by_wsum64_states_it_in_its_receipt(wsum64_exports, fault):
    """`local` moves blocks exported with device checksums: the receipt names `wsum64`
    and the bytes are the sender's; a corrupted piece fails CHECKSUM."""
    source, dest = random_pool(seed=6), random_pool(seed=7)
    options = TransportOptions(
        token="secret", timeout_s=5.0, chunk_bytes=1536, faults=FaultOptions(mode=fault)
    )
    sender = make_sender("local", "prefill-w", source, options)
    receiver = make_receiver("local", "decode-w", dest, options)
    try:
        ticket = sender.export("r", [9, 2, 3, 4], 32, "decode-w")
        assert ticket.checksum_algo == WSUM64
        assert ticket.checksums == wsum64(source.kv, [9, 2, 3, 4])
        result = receiver.fetch(ticket, [20, 21, 30, 31], timeout_s=5)
    finally:
        receiver.close()
        sender.close()
    if fault == "corrupt":
        assert (result.ok, result.reason, result.checksum) == (False, FailureReason.CHECKSUM, "")
    else:
        assert (result.ok, result.checksum, result.transport) == (True, WSUM64, "local")
        assert torch.equal(dest.kv[[20, 21, 30, 31]], source.kv[[9, 2, 3, 4]])


def test_cpu_pools_keep_xxh3_and_say_so_in_the_receipt():
    source, dest = random_pool(seed=8), random_pool(seed=9)
    sender = make_sender("local", "prefill-x", source, OPTIONS)
    receiver = make_receiver("local", "decode-x", dest, OPTIONS)
    try:
        ticket = sender.export("r", [1, 2], 16, "decode-x")
        result = receiver.fetch(ticket, [5, 6], timeout_s=5)
    finally:
        receiver.close()
        sender.close()
    assert (ticket.checksum_algo, result.ok, result.checksum) == ("xxh3_64", True, "xxh3_64")


def test_a_cpu_pool_has_no_transfer_stream():
    stream = TransferStream(torch.device("cpu"))
    assert stream.stream is None
    with stream.active():
        pass
    assert stream.wait_done() and stream.wait_done(timeout_s=0.001)


def test_nccl_pair_groups_are_made_after_the_failure_policy_is_set(monkeypatch):
    """A dead peer fails the transfer (blocking wait raises in the fetch), the watchdog
    aborts only the pair's communicator, and the monitor does not kill the worker: the
    environment torch reads is set when, and before, the NCCL group is made."""
    from kv_transfer.transports import collective

    for name in collective.NCCL_FAILURE_POLICY:
        monkeypatch.setenv(name, "surviving-worker-killed")  # what must not stay
    seen = {}

    class FakeNCCLGroup:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            seen.update({k: os.environ[k] for k in collective.NCCL_FAILURE_POLICY})
            seen["args"] = (rank, size, options._timeout.total_seconds())

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCLGroup, raising=False)
    group = collective.make_pair_group(
        dist.HashStore(), "kv/p/d/x", 1, "127.0.0.1", torch.device("cuda", 0), 7.0
    )
    assert isinstance(group, FakeNCCLGroup)
    assert seen == {
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "args": (1, 2, 7.0),
    }
