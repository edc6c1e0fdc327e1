"""Push (`kv_transfer_mode: push`): one standing transfer per request, opened by the
receiver before any of the request's KV exists, down which the sender sends each run
of blocks the moment it is exported.

Lifecycle of one followed export:
    decode worker, its blocks reserved: `receiver.follow(source, request_id, first_block,
      dst, ...)` opens the transfer (shm and collective: a `Follow` on a control
      connection; gRPC: the `Follow` RPC; local: a direct call), naming every block it
      still needs (those from `first_block` on: the leading ones its prefix cache holds
      are not sent)
    -> sender, on that transfer's server thread: `pushed_segments` waits for the export's
       blocks from `first_block` on (the export may not exist yet: its prompt is still
       queued) and yields each new run as soon as `export_segment` added it: a
       `SegmentNote` (block ids, checksums) goes out, then its bytes (shm: the receiver
       copies them out of the pool file; collective, gRPC: the sender sends them)
    -> while nothing comes, `Waiting` every `KEEPALIVE_S`: the receiver checks its cancel
       and deadline on each message, and either side sees the other's death as the
       transfer breaking
    -> after the final segment: done. The export's lease, ack and release are a pull's.
The receiver owns its destination blocks throughout and writes them itself, as in a
pull; each segment is verified against its note's checksums before it counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from engine import clock
from kv_transfer.base import (
    ExportTicket,
    FailureReason,
    KVTransferError,
    StreamSegment,
)
from kv_transfer.control_messages import SegmentNote
from kv_transfer.integrity import BlockVerifier
from kv_transfer.ownership import ExportRegistry

KEEPALIVE_S = 0.25
"""Longest silence of a standing transfer: a `Waiting` note goes out at least this often."""


class ExportGone(KeyError):
    """The followed export was released (or never came within its lease's time)."""


def pushed_segments(
    registry: ExportRegistry,
    request_id: str,
    first_block: int,
    appear_within_s: float,
    block_nbytes: int = 0,
    keepalive_s: float = KEEPALIVE_S,
) -> Iterator[SegmentNote | None]:
    """Sender side: each new run of the export's blocks from `first_block` on, as soon as
    it exists, and None whenever `keepalive_s` passed without one; ends after the final
    segment. Raises ExportGone when the export is released before that, or does not
    appear within `appear_within_s` (its prefill never started)."""
    have = first_block
    since = time.monotonic()
    while True:
        record = registry.wait_for_blocks(request_id, have, keepalive_s)
        if record is None:
            if registry.released(request_id) or time.monotonic() - since > appear_within_s:
                raise ExportGone(request_id)
            yield None
            continue
        since = time.monotonic()
        end = len(record.block_ids)
        if end > have:
            final = record.complete
            yield SegmentNote(
                have, record.block_ids[have:], record.checksums[have:], record.num_tokens, final
            )
            # Counted served once sent (shm: announced; the receiver copies them itself).
            registry.end_transfer(request_id, (end - have) * block_nbytes)
            have = end
            if final:
                return
        elif record.complete:
            return  # the receiver holds every block (its prefix cache): nothing to send
        else:
            yield None


SegmentLanded = Callable[[ExportTicket, float, float, int], None]
"""`on_segment(segment ticket, when its note arrived, when it landed, bytes moved)`,
receiver-side clock (the decode worker's)."""


class FollowedSegments:
    """Receiver side of one standing transfer: turns each note into the segment's ticket,
    its destination blocks and a verifier, and reports each verified segment."""

    def __init__(
        self,
        ticket: ExportTicket,
        first_block: int,
        dst_block_ids: list[int],
        block_nbytes: int,
        on_segment: SegmentLanded,
        verifier_for: Callable[[list[int], ExportTicket], BlockVerifier],
    ):
        self.ticket = ticket
        """The source ticket with the request's id: no blocks, the sender's endpoint."""
        self.first_block = first_block
        self.next_block = first_block
        self.dst = dst_block_ids
        self.block_nbytes = block_nbytes
        self.on_segment = on_segment
        self._verifier_for = verifier_for
        self.num_bytes = 0
        self.done = False

    def open(self, note: SegmentNote) -> tuple[ExportTicket, list[int], BlockVerifier, float]:
        """A segment was announced: (its ticket, its blocks here, its verifier, when)."""
        arrived = clock.now()
        index = note.first_block - self.first_block
        dst = self.dst[index : index + len(note.block_ids)]
        if note.first_block != self.next_block or len(dst) != len(note.block_ids):
            raise KVTransferError(
                f"segment at block {note.first_block} ({len(note.block_ids)} blocks) where "
                f"block {self.next_block} of {self.first_block + len(self.dst)} was next",
                self.ticket.request_id,
                self.ticket.sender_id,
                FailureReason.INTERNAL,
            )
        segment = replace(
            self.ticket,
            block_ids=list(note.block_ids),
            checksums=list(note.checksums),
            num_tokens=note.num_tokens,
            segment=StreamSegment(note.first_block, note.final),
        )
        return segment, dst, self._verifier_for(dst, segment), arrived

    def landed(self, segment: ExportTicket, verifier: BlockVerifier, arrived: float) -> None:
        """Its bytes are all in place: verify what was not yet, then report it."""
        verifier.finish()
        nbytes = len(segment.block_ids) * self.block_nbytes
        self.num_bytes += nbytes
        self.next_block = segment.segment.first_block + len(segment.block_ids)
        self.done = segment.segment.final
        self.on_segment(segment, arrived, clock.now(), nbytes)

    def ended(self) -> None:
        """The sender says the export is complete (the last blocks may all be ours)."""
        self.done = True
