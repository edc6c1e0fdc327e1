"""Streamed exports on a prefill worker: each prefill chunk's completed blocks are
exported as soon as its step ends.

Lifecycle of a streamed request here (`PrefillRequest.kv_stream` PULL or PUSH):
    `open` when the request arrives
    -> after every engine step (`after_step`, on the engine thread): the full blocks its
       chunks completed since the last segment join its export (`export_segment`), each
       block pinned for the export by one more reference, so that the export owns its
       blocks whatever the sequence does next (a preemption frees only the sequence's
       references; the export's KV stays put and valid)
    -> the step that samples the first token: `export_final` exports the rest (the last,
       partial block with it) as the final segment and drops the sequence's references
    -> `close` (exported, finished at its first token, aborted, failed). The export
       itself ends as any other: ack, abort or lease expiry.
A segment's blocks are full and never written again, so its checksums stay true.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.sequence import SequenceStatus
from kv_transfer.base import ExportTicket, KVSender


@dataclass
class _Stream:
    peer_id: str
    relay: bool
    """Hand each segment's ticket to the request's stream (pull); push sends them itself."""
    per_chunk: bool = True
    """Export after each chunk; False: only the final segment (the whole prompt)."""
    published: int = 0
    """Leading blocks of the request already in its export."""
    segments: int = 0


class SegmentPublisher:
    """One per prefill worker; every method runs on the engine thread."""

    def __init__(self, sender: KVSender, block_size: int):
        self.sender = sender
        self.block_size = block_size
        self.streams: dict[str, _Stream] = {}

    def open(self, request_id: str, peer_id: str, relay: bool, per_chunk: bool = True) -> None:
        self.streams[request_id] = _Stream(peer_id, relay, per_chunk)

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def streaming(self, request_id: str) -> bool:
        return request_id in self.streams

    def segments(self, request_id: str) -> int:
        stream = self.streams.get(request_id)
        return stream.segments if stream is not None else 0

    def after_step(self, engine: LLMEngine) -> list[tuple[str, ExportTicket]]:
        """Export what the step just completed; returns the (request id, ticket) pairs to
        relay. A sequence the step prefilled to the end is left to `export_final`."""
        relayed = []
        for request_id, stream in self.streams.items():
            seq = engine.sequences.get(request_id)
            if not stream.per_chunk or seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
            if full <= stream.published:
                continue
            blocks = seq.block_ids[stream.published : full]
            ticket = self.sender.export_segment(
                request_id, blocks, stream.published, full * self.block_size, stream.peer_id
            )
            engine.pin_blocks(blocks)
            stream.published = full
            stream.segments += 1
            if stream.relay:
                relayed.append((request_id, ticket))
        return relayed

    def export_final(self, engine: LLMEngine, request_id: str) -> tuple[ExportTicket, ExportTicket]:
        """The PREFILLED sequence's remaining blocks as the final segment; returns (the
        whole export's ticket, the final segment's). Raises as `export_prefilled` does."""
        stream = self.streams[request_id]

        def export(seq) -> ExportTicket:
            blocks = seq.block_ids[stream.published :]
            ticket = self.sender.export_segment(
                request_id,
                blocks,
                stream.published,
                seq.num_prompt_tokens,
                stream.peer_id,
                final=True,
            )
            engine.pin_blocks(blocks)
            return ticket

        segment = engine.export_prefilled(request_id, export, hand_over=False)
        stream.segments += 1
        return self.sender.whole_ticket(request_id), segment
