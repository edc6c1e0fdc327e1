"""CUDA graphs for decode steps, one per batch bucket (and table-width bucket).

A decode step launches a few hundred small kernels; on a GPU their launch cost is a
large part of the step at small batch. Lifecycle: the engine builds its `ModelRunner`
with `cuda_graphs` on and calls `capture_graphs` before the worker reports healthy:
`DecodeGraphs.capture_all` captures one graph per batch bucket up to `max_num_seqs`
(times one per table-width bucket where the backend gathers blocks to the table's
width; one width where it reads them in place), into one shared memory pool, and logs
the time and memory that took. The serving path never captures: `ModelRunner` hands
each decode-only step that a captured bucket covers to `run`, which copies the step
into that bucket's static input tensors and replays the graph; any other step runs
eagerly.

Every write a graph makes outside a real row lands in the scratch block, a KV block
the allocator never hands out (`BlockAllocator(keep_scratch=True)`): the warm-up
forward before each capture runs on the static tensors' resting state (token 0 at
position 0 of the scratch block), and padding rows (up to the bucket) are put back in
that state before every replay. No live sequence's or cached prefix's KV is touched.
With `capture=False` the same steps run eagerly; that is how the CPU test suite checks
the padding and the scratch writes.
"""

from __future__ import annotations

import logging
import time
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


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch buckets a decode step of at most `max_num_seqs` rows can land in."""
    top = bucket_for(max_num_seqs, BATCH_BUCKETS) or BATCH_BUCKETS[-1]
    return tuple(b for b in BATCH_BUCKETS if b <= top)


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
    """Owned by a `ModelRunner` on CUDA: `capture_all` once at start-up, then `covers`
    and `run` per decode-only step."""

    def __init__(
        self,
        model,
        kv_pool,
        scratch_block: int,
        max_model_len: int | None = None,
        capture: bool = True,
    ):
        self.model = model
        self.kv_pool = kv_pool
        self.scratch_block = scratch_block
        self.capture = capture
        max_len = max_model_len or model.rope.cos.shape[0]
        max_width = -(-max_len // kv_pool.block_size)
        in_place = model.attention.reads_in_place
        self.widths = (max_width,) if in_place else width_buckets(max_width)
        self.steps: dict[tuple[int, int], _StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        """Decode steps served from a captured bucket so far."""

    def capture_all(self, max_num_seqs: int) -> None:
        """Capture (or, without `capture`, warm up) every bucket a decode step of at most
        `max_num_seqs` rows can need; called once, at engine start-up."""
        on_cuda = torch.device(self.model.device).type == "cuda"
        free_before = _free_device_bytes() if on_cuda else 0
        started = time.perf_counter()
        batches = batch_buckets(max_num_seqs)
        for batch in batches:
            for width in self.widths:
                self.steps[(batch, width)] = self._build(batch, width)
        if on_cuda:
            torch.cuda.synchronize()
        logger.info(
            "%s %d decode graphs (batches %s, %d table widths) in %.2fs, %.1f MiB of device memory",
            "captured" if self.capture else "warmed up",
            len(self.steps),
            ",".join(map(str, batches)),
            len(self.widths),
            time.perf_counter() - started,
            (free_before - (_free_device_bytes() if on_cuda else 0)) / 2**20,
        )

    def covers(self, step) -> bool:
        return self.model.graph_safe and step.decode_only and self._key(step) in self.steps

    def run(self, step) -> torch.Tensor:
        """Logits [num_rows, vocab] of a decode-only step that `covers` accepted."""
        rows = step.input_ids.shape[0]
        static = self.steps[self._key(step)]
        _fill(static, step, self.scratch_block)
        self.replays += 1
        if static.graph is None:
            return self._forward(static)[:rows]
        static.graph.replay()
        return static.logits[:rows].clone()

    def _key(self, step) -> tuple[int | None, int | None]:
        return (
            bucket_for(step.input_ids.shape[0], BATCH_BUCKETS),
            bucket_for(step.meta.decode_block_tables.shape[1], self.widths),
        )

    def _forward(self, static: _StaticStep) -> torch.Tensor:
        return self.model.forward(
            static.input_ids, static.positions, static.meta, self.kv_pool, static.logits_rows
        )

    def _build(self, batch: int, width: int) -> _StaticStep:
        device = self.model.device

        def longs(*shape, value=0):
            return torch.full(shape, value, dtype=torch.long, device=device)

        meta = AttentionMetadata(
            slot_blocks=longs(batch, value=self.scratch_block),
            slot_offsets=longs(batch),
            num_decode_tokens=batch,
            decode_block_tables=longs(batch, width, value=self.scratch_block),
            decode_context_lens=longs(batch, value=1),
        )
        static = _StaticStep(longs(batch), longs(batch), meta, torch.arange(batch, device=device))
        if self.capture:
            self._capture(static)
        else:
            self._forward(static)  # the warm-up a capture runs, eagerly
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


def _free_device_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _fill(static: _StaticStep, step, scratch_block: int) -> None:
    """Copy a step into the static tensors; rows past the step's go back to the resting
    state (token 0 at position 0 of the scratch block, which their KV write lands in)."""
    rows = step.input_ids.shape[0]
    width = step.meta.decode_block_tables.shape[1]
    meta, source = static.meta, step.meta
    pairs = (
        (static.input_ids, step.input_ids, 0),
        (static.positions, step.positions, 0),
        (meta.slot_blocks, source.slot_blocks, scratch_block),
        (meta.slot_offsets, source.slot_offsets, 0),
        (meta.decode_context_lens, source.decode_context_lens, 1),
    )
    for target, values, resting in pairs:
        target[:rows].copy_(values)
        target[rows:].fill_(resting)
    tables = meta.decode_block_tables
    tables.fill_(scratch_block)
    tables[:rows, :width].copy_(source.decode_block_tables)
