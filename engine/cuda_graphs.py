"""CUDA graphs for decode steps, one per (batch bucket, block-table width bucket).

A decode step launches a few hundred small kernels; on a GPU their launch cost is a
large part of the step at small batch. `ModelRunner` hands decode-only steps here:
the step is padded up to the next bucket, copied into that bucket's static input
tensors, and the captured graph is replayed. Graphs are captured lazily, on a bucket's
first use, into one shared memory pool.

Padding rows repeat the batch's last real row (same token, position, KV slot and
block table): they write the very same key and value into the same slot and their
logits are dropped, so they need no spare KV block. With `capture=False` the padded
step runs eagerly; that is how the CPU test suite checks the padding logic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(value: int, buckets) -> int | None:
    """Smallest bucket >= value, or None when value exceeds them all."""
    return next((b for b in buckets if b >= value), None)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Powers of two up to (and including) the widest table the model can need."""
    widths, width = [], 1
    while width < max_width:
        widths.append(width)
        width *= 2
    return (*widths, max_width)


@dataclass
class _StaticStep:
    """Input and output tensors a captured graph reads and writes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    logits: torch.Tensor | None = None
    graph: object | None = None


class DecodeGraphs:
    """Owned by a `ModelRunner` on CUDA; `covers` then `run` per decode-only step."""

    def __init__(self, model, kv_pool, max_model_len: int | None = None, capture: bool = True):
        self.model = model
        self.kv_pool = kv_pool
        self.capture = capture
        max_len = max_model_len or model.rope.cos.shape[0]
        self.widths = width_buckets(-(-max_len // kv_pool.block_size))
        self.steps: dict[tuple[int, int], _StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def covers(self, step) -> bool:
        tables = step.meta.decode_block_tables
        return (
            self.model.graph_safe
            and step.decode_only
            and bucket_for(step.input_ids.shape[0], BATCH_BUCKETS) is not None
            and bucket_for(tables.shape[1], self.widths) is not None
        )

    def run(self, step) -> torch.Tensor:
        """Logits [num_rows, vocab] of a decode-only step, through its bucket's graph."""
        rows = step.input_ids.shape[0]
        key = (
            bucket_for(rows, BATCH_BUCKETS),
            bucket_for(step.meta.decode_block_tables.shape[1], self.widths),
        )
        static = self.steps.get(key) or self._build(*key)
        _fill(static, step)
        if static.graph is None:
            return self._forward(static)[:rows]
        static.graph.replay()
        return static.logits[:rows].clone()

    def _forward(self, static: _StaticStep) -> torch.Tensor:
        return self.model.forward(
            static.input_ids, static.positions, static.meta, self.kv_pool, static.logits_rows
        )

    def _build(self, batch: int, width: int) -> _StaticStep:
        device = self.model.device

        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.long, device=device)

        meta = AttentionMetadata(
            slot_blocks=zeros(batch),
            slot_offsets=zeros(batch),
            num_decode_tokens=batch,
            decode_block_tables=zeros(batch, width),
            decode_context_lens=torch.ones(batch, dtype=torch.long, device=device),
        )
        static = _StaticStep(zeros(batch), zeros(batch), meta, torch.arange(batch, device=device))
        if self.capture:
            self._capture(static)
        self.steps[(batch, width)] = static
        return static

    def _capture(self, static: _StaticStep) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(static)  # warm-up: lazy initialisation stays out of the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static.logits = self._forward(static)
        static.graph = graph
        logger.info("captured decode graph for batch %d", static.input_ids.shape[0])


def _fill(static: _StaticStep, step) -> None:
    """Copy a step into the static tensors; rows past the step's repeat its last row."""
    rows = step.input_ids.shape[0]
    width = step.meta.decode_block_tables.shape[1]
    meta, source = static.meta, step.meta
    pairs = (
        (static.input_ids, step.input_ids),
        (static.positions, step.positions),
        (meta.slot_blocks, source.slot_blocks),
        (meta.slot_offsets, source.slot_offsets),
        (meta.decode_context_lens, source.decode_context_lens),
    )
    for target, values in pairs:
        target[:rows].copy_(values)
        target[rows:].copy_(values[rows - 1])
    tables = meta.decode_block_tables
    tables.zero_()
    tables[:rows, :width].copy_(source.decode_block_tables)
    tables[rows:, :width].copy_(source.decode_block_tables[rows - 1])
