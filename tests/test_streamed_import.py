"""A decode worker's streamed import when its receiver raises instead of reporting a
failure as data: the import must settle failed, never wait for blocks forever."""

from __future__ import annotations

from dataclasses import replace

import pytest

from decode_worker.streamed_import import StreamedImport
from kv_transfer.base import ExportTicket, FailureReason, StreamSegment
from kv_transfer.endpoints import SenderEndpoint

# The import never reads a ticket's layout: the receiver checks it.
TICKET = ExportTicket(
    "req-1", "prefill-0", SenderEndpoint("shm", "prefill-0", "node"), None, [], 0, 30.0
)


class RaisingReceiver:
    name = "raising"

    def follow(self, *args):
        raise RuntimeError("no push here")

    def fetch(self, *args):
        raise RuntimeError("no pull here")

    def cancel(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_receiver_that_raises_fails_the_import(mode):
    settled: list[StreamedImport] = []
    imported = StreamedImport(
        "req-1",
        RaisingReceiver(),
        timeout_s=1.0,
        submit=lambda work: work(),
        settle=settled.append,
        source=TICKET if mode == "push" else None,
    )
    imported.reserved([3, 4], held=0)
    if mode == "pull":
        segment = StreamSegment(first_block=0, final=True)
        imported.add(replace(TICKET, block_ids=[7, 8], num_tokens=20, segment=segment))
    assert settled == [imported]
    assert imported.failure.reason == FailureReason.INTERNAL
    assert "RuntimeError" in imported.failure.message
