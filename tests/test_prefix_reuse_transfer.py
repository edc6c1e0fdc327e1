"""Decode-side reuse over every transport: a receiver whose prefix cache holds an
export's leading blocks pulls only the rest, and exactly their bytes move."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import ExportTicket, TransportOptions, make_receiver, make_sender
from tests.kv_transfer_peer import LAYOUT, random_pool

OPTIONS = TransportOptions(chunk_bytes=8 << 10, token="cluster-secret", timeout_s=20)
EXPORTED = [5, 9, 2, 3, 11, 12, 13]
"""Sender-side block ids of one prompt, in sequence order (runs and jumps on purpose)."""


@pytest.mark.parametrize("transport", ["local", "shm", "collective", "grpc"])
@pytest.mark.parametrize("held", [0, 1, 4, 6])
def test_only_the_missing_blocks_move(transport, held):
    source = random_pool(seed=1)
    dest = random_pool(seed=2)
    sender = make_sender(transport, f"prefill-{transport}-{held}", source, OPTIONS)
    receiver = make_receiver(transport, f"decode-{transport}-{held}", dest, OPTIONS)
    try:
        ticket = sender.export("r", EXPORTED, len(EXPORTED) * LAYOUT.block_size, "decode")
        ticket = ExportTicket.from_dict(ticket.to_dict())  # as it travels
        dst = [20 + i for i in range(len(EXPORTED) - held)]
        untouched = dest.kv.clone()

        result = receiver.fetch(ticket, dst, timeout_s=20, held_blocks=held)

        assert result.ok, result.message
        block_bytes = LAYOUT.block_nbytes
        assert result.num_bytes == (len(EXPORTED) - held) * block_bytes
        assert torch.equal(dest.kv[dst], source.kv[EXPORTED[held:]])
        others = [b for b in range(dest.num_blocks) if b not in dst]
        assert torch.equal(dest.kv[others], untouched[others])  # nothing else written
        assert sender.stats().bytes_sent == result.num_bytes
        assert receiver.stats().bytes_received == result.num_bytes
        sender.ack("r")
        assert sender.poll_released() == [EXPORTED]  # the whole export, exactly once
    finally:
        receiver.close()
        sender.close()


def test_a_pull_for_more_blocks_than_exported_fails_as_data():
    source, dest = random_pool(seed=1), random_pool(seed=2)
    sender = make_sender("grpc", "prefill-over", source, OPTIONS)
    receiver = make_receiver("grpc", "decode-over", dest, OPTIONS)
    try:
        ticket = sender.export("r", EXPORTED[:2], 2 * LAYOUT.block_size, "decode")
        with pytest.raises(ValueError):
            ticket.tail(2)  # nothing would be left to pull
        result = receiver.fetch(ticket, [1, 2, 3], timeout_s=5)
        assert not result.ok
    finally:
        receiver.close()
        sender.close()
