"""KV between tensor-parallel splits: in one process over the `local` transport, every
sender split (1, 2, 4 ranks) into every receiver split, KV heads replicated below the
rank count, held prefix blocks, a corrupted slice and the plans themselves; between
two processes, a split sender into one rank and one sender into a split receiver over
every cross-process transport."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.kv_cache import KVCachePool, KVLayout
from engine.parallel.shard import Span, head_split
from kv_transfer.base import ExportTicket, FailureReason
from kv_transfer.config import TransportOptions
from kv_transfer.registry import make_receiver, make_sender
from kv_transfer.resharding import ReshardingReceiver, plan_slices
from tests.kv_transfer_peer import LAYOUT, Peer, split_layout

OPTIONS = TransportOptions()
HEADS, KV_HEADS, BLOCKS = 8, 4, 12
SENDER_BLOCKS = [3, 4, 5, 9, 1]
RECEIVER_BLOCKS = [7, 2, 8, 0, 11]
_IDS = itertools.count()


def layout(size: int, rank: int, kv_heads: int = KV_HEADS) -> KVLayout:
    heads = head_split(HEADS, kv_heads, size, rank).kv
    return KVLayout(
        model_id="m",
        dtype="float32",
        num_layers=2,
        num_kv_heads=heads.count,
        head_dim=4,
        block_size=4,
        tp_size=size,
        tp_rank=rank,
        kv_head_start=heads.start,
        total_kv_heads=kv_heads if size > 1 else 0,
    )


def full_kv(kv_heads: int = KV_HEADS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(kv_heads)
    return torch.randn(BLOCKS, 2, 2, 4, kv_heads, 4, generator=generator)


def exported(size: int, kv_heads: int = KV_HEADS):
    """A sender split of `size` ranks holding `full_kv`'s heads; its ticket (rank 0's,
    with the other ranks' as shards) and its senders."""
    full, run = full_kv(kv_heads), next(_IDS)
    senders, tickets = [], []
    for rank in range(size):
        pool = KVCachePool(layout(size, rank, kv_heads), BLOCKS)
        heads = pool.layout.kv_heads
        pool.kv.copy_(full[:, :, :, :, heads.start : heads.stop])
        sender = make_sender("local", f"p{run}.rank{rank}", pool, OPTIONS)
        senders.append(sender)
        tickets.append(sender.export("req", SENDER_BLOCKS, 17, "d"))
    return tickets[0].with_shards(tickets[1:]), senders, full


def receivers(size: int, kv_heads: int = KV_HEADS) -> list[ReshardingReceiver]:
    run = next(_IDS)
    made = []
    for rank in range(size):
        pool = KVCachePool(layout(size, rank, kv_heads), BLOCKS)

        def make(name, into):
            return make_receiver("local", name, into, OPTIONS)

        made.append(ReshardingReceiver(make(f"d{run}.rank{rank}", pool), make, BLOCKS))
    return made


@pytest.mark.parametrize(
    ("senders", "receivers_", "kv_heads"),
    [
        *[(a, b, KV_HEADS) for a in (1, 2, 4) for b in (1, 2, 4)],
        (2, 1, 1),
        (1, 2, 1),
        (4, 2, 2),
        (2, 4, 1),
    ],
)
def test_every_split_fills_every_split(senders, receivers_, kv_heads):
    ticket, sender_list, full = exported(senders, kv_heads)
    for receiver in receivers(receivers_, kv_heads):
        result = receiver.fetch(ticket, RECEIVER_BLOCKS, 10.0)
        assert result.ok, result.message
        heads = receiver.pool.layout.kv_heads
        wanted = full[SENDER_BLOCKS][:, :, :, :, heads.start : heads.stop]
        assert torch.equal(receiver.pool.kv[RECEIVER_BLOCKS], wanted)
        covered = sorted((s.first_kv_head, s.kv_heads) for s in result.slices)
        assert sum(count for _, count in covered) == heads.count
        assert covered[0][0] == heads.start
        for receipt in result.slices:
            sent = ticket.slices[receipt.sender_rank].layout
            assert receipt.num_bytes == sent.block_nbytes * len(SENDER_BLOCKS)
            assert receipt.staged == (sent.kv_heads != heads)
            assert receipt.checksum == ticket.checksum_algo
        assert result.num_bytes == sum(s.num_bytes for s in result.slices)
    for sender in sender_list:
        sender.close()


def test_held_prefix_blocks_are_not_pulled_on_any_slice():
    ticket, _, full = exported(2)
    (receiver,) = receivers(1)
    before = receiver.pool.kv[RECEIVER_BLOCKS[:2]].clone()
    result = receiver.fetch(ticket, RECEIVER_BLOCKS[2:], 10.0, held_blocks=2)
    assert result.ok, result.message
    assert torch.equal(receiver.pool.kv[RECEIVER_BLOCKS[:2]], before)
    assert torch.equal(receiver.pool.kv[RECEIVER_BLOCKS[2:]], full[SENDER_BLOCKS[2:]])
    assert [s.num_bytes for s in result.slices] == [
        s.layout.block_nbytes * 3 for s in ticket.slices
    ]


def test_a_corrupted_slice_fails_its_checksum_naming_its_sender():
    ticket, senders, _ = exported(2)
    senders[1].pool.kv[SENDER_BLOCKS[1]].view(-1)[0] += 1.0  # after the export's checksums
    (receiver,) = receivers(1)
    result = receiver.fetch(ticket, RECEIVER_BLOCKS, 10.0)
    assert not result.ok
    assert result.reason == FailureReason.CHECKSUM
    assert senders[1].worker_id in result.message and "positions [1]" in result.message


def test_plans_take_each_head_once_and_refuse_other_kv():
    ticket, _, _ = exported(4)
    plans = plan_slices(ticket, layout(1, 0))
    assert [(p.ticket.layout.tp_rank, p.heads, p.direct) for p in plans] == [
        (rank, Span(rank, 1), False) for rank in range(4)
    ]
    (direct,) = plan_slices(ticket, layout(4, 2))
    assert (direct.ticket.layout.tp_rank, direct.direct) == (2, True)
    replicated, _, _ = exported(2, kv_heads=1)  # both ranks hold head 0: rank 0's is taken
    (only,) = plan_slices(replicated, layout(1, 0, kv_heads=1))
    assert (only.ticket.layout.tp_rank, only.direct) == (0, True)
    other = KVLayout(**{**layout(1, 0).as_dict(), "block_size": 8})
    (receiver,) = receivers(1)
    receiver.pool = KVCachePool(other, BLOCKS)
    result = receiver.fetch(ticket, RECEIVER_BLOCKS, 10.0)
    assert result.reason == FailureReason.LAYOUT_MISMATCH
    assert "block_size=4" in result.message and "block_size=8" in result.message


# --- between processes, over every transport ----------------------------------------

PEER_OPTIONS = TransportOptions(chunk_bytes=16 << 10, token="cluster-secret", timeout_s=20)


@pytest.fixture(scope="module")
def random_peer():
    peer = Peer()
    yield peer
    peer.close()


def peer_receiver(transport: str, pool_layout: KVLayout, name: str) -> ReshardingReceiver:
    pool = KVCachePool(pool_layout, 16)

    def make(receiver_name, into):
        return make_receiver(transport, receiver_name, into, PEER_OPTIONS)

    return ReshardingReceiver(make(name, pool), make, 16)


@pytest.mark.parametrize("transport", ["shm", "grpc", "collective"])
def test_split_senders_and_receivers_between_processes(random_peer, transport):
    """Prefill tp=2 -> decode tp=1 (two staged slices), then prefill tp=1 -> decode tp=2
    (each rank one staged slice of whole blocks), each block checked against the
    unsplit pool's bytes."""
    dst = [3, 0, 9, 4]
    shape = (len(dst), *LAYOUT.block_shape)
    ticket, sent = random_peer.call(
        "export_split", f"split-{transport}", transport, PEER_OPTIONS, "two-to-one", 4, 2
    )
    ticket = ExportTicket.from_dict(ticket)
    receiver = peer_receiver(transport, LAYOUT, f"one-{transport}")
    try:
        result = receiver.fetch(ticket, dst, 20.0)
        assert result.ok, result.message
        got = receiver.pool.kv[dst].numpy().tobytes()
    finally:
        receiver.close()
    assert got == sent
    assert [(s.sender_rank, s.first_kv_head, s.staged) for s in result.slices] == [
        (0, 0, True),
        (1, 1, True),
    ]
    random_peer.call("ack", f"split-{transport}", "two-to-one")

    random_peer.call("open_sender", f"whole-{transport}", transport, PEER_OPTIONS)
    ticket, sent = random_peer.call("export_random", f"whole-{transport}", "one-to-two", 4)
    ticket = ExportTicket.from_dict(ticket)
    full = torch.frombuffer(bytearray(sent), dtype=torch.float32).view(shape)
    for rank in range(2):
        receiver = peer_receiver(transport, split_layout(2, rank), f"two-{transport}.rank{rank}")
        try:
            result = receiver.fetch(ticket, dst, 20.0)
            assert result.ok, result.message
            assert torch.equal(receiver.pool.kv[dst], full[:, :, :, :, rank : rank + 1])
        finally:
            receiver.close()
        (receipt,) = result.slices
        assert (receipt.receiver_rank, receipt.first_kv_head, receipt.staged) == (rank, rank, True)
        assert receipt.num_bytes == len(sent)  # whole blocks moved, half kept
    random_peer.call("ack", f"whole-{transport}", "one-to-two")
    assert random_peer.call("wait_all_free") == 0
