"""KV between pools split over different tensor-parallel sizes, head slice by head slice.

A tensor-parallel worker's ranks each hold a range of the model's KV heads in a pool of
their own (`KVLayout.kv_heads`), with the same block ids on every rank. A prefill
worker of a ranks exports one ticket per rank (rank 0's carries the others in
`ExportTicket.shards`); each rank of a decode worker of b ranks must end up with its
own heads of every exported block. So each decode rank plans its fetch (`plan_slices`):
walking its heads in order, each comes from the first prefill rank that holds it, and
each maximal run from one prefill rank is one slice:

    P tp=1 -> D tp=1, P tp=b -> D tp=b   one slice per decode rank, the same heads on
                                         both sides: pulled straight into the pool
    P tp=2 -> D tp=1                     decode rank 0 pulls two slices (heads 0..h/2-1
                                         from prefill rank 0, the rest from rank 1)
    P tp=1 -> D tp=2                     each decode rank pulls one slice of prefill
                                         rank 0's blocks and keeps its half of the heads

A slice whose heads are not exactly the pool's is staged: pulled whole into a staging
pool laid out as the sender rank's (the transport, its checksums, its lease calls
unchanged: every transport moves it as any other pull), then its heads copied into the
destination blocks, one local copy per slice (`StagingArea`). Every slice is verified
against its own sender rank's checksums. The result lists a `SliceReceipt` per slice:
who sent which heads, and the bytes that moved.

`ReshardingReceiver` is what a decode worker's rank holds: the transport's receiver of
its own pool, plus one staging area per sender layout it has met. Layouts that cannot
meet (another model, dtype or block size) fail the fetch with LAYOUT_MISMATCH naming
both; the cluster refuses such pairings at start-up (`ClusterConfig.check_tp`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.kv_cache import KVCachePool, KVLayout
from engine.parallel.shard import Span
from kv_transfer.base import (
    ExportTicket,
    FailureReason,
    KVReceiver,
    KVTransferError,
    SliceReceipt,
    TransferResult,
    TransferState,
)
from kv_transfer.stats import ReceiverStats, bump

ReceiverFactory = Callable[[str, KVCachePool], KVReceiver]
"""(receiver id, pool) -> a receiver of the worker's transport into that pool."""


@dataclass(frozen=True)
class SlicePlan:
    """One sender rank's part of a fetch into one receiver rank's pool."""

    ticket: ExportTicket
    """The sender rank's export (no shards)."""
    heads: Span
    """The model's KV heads this slice brings."""
    direct: bool
    """The slice holds exactly the pool's heads: it lands straight in the pool."""


def plan_slices(ticket: ExportTicket, local: KVLayout) -> list[SlicePlan]:
    """The slices of `ticket` (any sender split) that give a pool laid out as `local`
    its heads; raises LAYOUT_MISMATCH when a sender rank's blocks are another model's
    KV, or the senders' heads do not cover ours."""
    slices = ticket.slices
    for part in slices:
        if not part.layout.same_kv(local):
            raise KVTransferError(
                f"sender rank {part.layout.tp_rank}/{part.layout.tp_size}'s layout "
                f"{part.layout} cannot fill this pool's {local}",
                ticket.request_id,
                part.sender_id,
                FailureReason.LAYOUT_MISMATCH,
            )
    wanted = local.kv_heads
    exact = next((p for p in slices if p.layout.kv_heads == wanted), None)
    if exact is not None:
        return [SlicePlan(exact, wanted, direct=True)]
    plans, head = [], wanted.start
    while head < wanted.stop:
        holder = next(
            (p for p in slices if p.layout.kv_heads.start <= head < p.layout.kv_heads.stop), None
        )
        if holder is None:
            raise KVTransferError(
                f"no sender rank holds KV head {head} (senders hold "
                f"{[(p.layout.kv_heads.start, p.layout.kv_heads.count) for p in slices]})",
                ticket.request_id,
                ticket.sender_id,
                FailureReason.LAYOUT_MISMATCH,
            )
        run = holder.layout.kv_heads.overlap(Span(head, wanted.stop - head))
        plans.append(SlicePlan(holder, run, direct=False))
        head = run.stop
    return plans


class StagingArea:
    """A staging pool laid out as one sender rank's, with the transport's receiver into
    it; one staged slice at a time (its lock), in blocks [0, n)."""

    def __init__(
        self, layout: KVLayout, blocks: int, device: str, make: ReceiverFactory, name: str
    ):
        self.pool = KVCachePool(layout, blocks, device)
        self.receiver = make(name, self.pool)
        self.lock = threading.Lock()

    def fetch_into(
        self,
        plan: SlicePlan,
        pool: KVCachePool,
        dst_block_ids: list[int],
        timeout_s: float,
        held_blocks: int,
    ) -> TransferResult:
        """Pull the slice's blocks here, then copy its heads into `pool`'s `dst_block_ids`."""
        count = len(dst_block_ids)
        if count > self.pool.num_blocks:
            raise KVTransferError(
                f"{count} blocks exceed the staging pool's {self.pool.num_blocks}",
                plan.ticket.request_id,
                plan.ticket.sender_id,
                FailureReason.INTERNAL,
            )
        with self.lock:
            result = self.receiver.fetch(plan.ticket, list(range(count)), timeout_s, held_blocks)
            if result.ok:
                source = plan.ticket.layout.kv_heads
                target = pool.layout.kv_heads
                src = slice(plan.heads.start - source.start, plan.heads.stop - source.start)
                dst = slice(plan.heads.start - target.start, plan.heads.stop - target.start)
                index = torch.as_tensor(dst_block_ids, dtype=torch.long, device=pool.kv.device)
                pool.kv[index, :, :, :, dst] = self.pool.kv[:count, :, :, :, src]
        return result

    def close(self) -> None:
        self.receiver.close()


class ReshardingReceiver(KVReceiver):
    """A decode rank's receiver: whole blocks straight into its pool when a sender rank
    holds exactly its heads, head slices through a staging area otherwise."""

    def __init__(
        self,
        receiver: KVReceiver,
        make: ReceiverFactory,
        staging_blocks: int,
    ):
        """`receiver`: the transport's, into this rank's pool; `make`: builds another
        into a staging pool; `staging_blocks`: each staging pool's blocks (the most one
        request can have)."""
        super().__init__(receiver.worker_id, receiver.pool)
        self.name = receiver.name
        self.direct = receiver
        self.make = make
        self.staging_blocks = staging_blocks
        self.areas: dict[KVLayout, StagingArea] = {}
        self._lock = threading.Lock()
        self._stats = ReceiverStats()

    def _area(self, layout: KVLayout) -> StagingArea:
        with self._lock:
            area = self.areas.get(layout)
            if area is None:
                name = f"{self.worker_id}.stage{len(self.areas)}"
                area = StagingArea(
                    layout, self.staging_blocks, str(self.pool.kv.device), self.make, name
                )
                self.areas[layout] = area
            return area

    def fetch(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        timeout_s: float,
        held_blocks: int = 0,
    ) -> TransferResult:
        start = time.monotonic()
        result = TransferResult(ticket.request_id, TransferState.FAILED, self.name)
        try:
            plans = plan_slices(ticket, self.pool.layout)
        except KVTransferError as exc:
            result.reason, result.message = exc.reason, str(exc)
            return self._count(result, start)
        if len(plans) == 1 and plans[0].direct and not ticket.shards:  # one rank to one
            own = replace(ticket, layout=self.pool.layout)  # the same bytes, ours
            outcome = self.direct.fetch(own, dst_block_ids, timeout_s, held_blocks)
            if outcome.ok:
                outcome.slices = [self._receipt(plans[0], outcome)]
            return self._count(outcome, start)
        for plan in plans:
            left = max(0.0, timeout_s - (time.monotonic() - start))
            if plan.direct:
                own = replace(plan.ticket, layout=self.pool.layout)  # the same bytes, ours
                outcome = self.direct.fetch(own, dst_block_ids, left, held_blocks)
            else:
                outcome = self._staged(plan, dst_block_ids, left, held_blocks)
            if not outcome.ok:
                result.reason, result.message = outcome.reason, outcome.message
                return self._count(result, start)
            result.transport, result.checksum = outcome.transport, outcome.checksum
            result.num_bytes += outcome.num_bytes
            result.slices.append(self._receipt(plan, outcome))
        result.state = TransferState.DONE
        return self._count(result, start)

    def _staged(self, plan: SlicePlan, dst_block_ids, timeout_s: float, held: int):
        try:
            area = self._area(plan.ticket.layout)
            return area.fetch_into(plan, self.pool, dst_block_ids, timeout_s, held)
        except Exception as exc:  # failures come back as data, as every fetch's do
            outcome = TransferResult(plan.ticket.request_id, TransferState.FAILED, self.name)
            reason = exc.reason if isinstance(exc, KVTransferError) else FailureReason.INTERNAL
            outcome.reason, outcome.message = reason, str(exc)
            return outcome

    def _receipt(self, plan: SlicePlan, outcome: TransferResult) -> SliceReceipt:
        return SliceReceipt(
            sender_rank=plan.ticket.layout.tp_rank,
            receiver_rank=self.pool.layout.tp_rank,
            first_kv_head=plan.heads.start,
            kv_heads=plan.heads.count,
            num_bytes=outcome.num_bytes,
            staged=not plan.direct,
            checksum=outcome.checksum,
        )

    def _count(self, result: TransferResult, start: float) -> TransferResult:
        result.seconds = time.monotonic() - start
        with self._lock:
            self._stats.fetches += 1
            if result.ok:
                self._stats.transfers_ok += 1
                self._stats.bytes_received += result.num_bytes
                self._stats.seconds += result.seconds
                bump(self._stats.by_transport, result.transport)
            elif result.reason is not None:
                bump(self._stats.failures, result.reason.value)
        return result

    def follow(
        self,
        source: ExportTicket,
        request_id: str,
        first_block: int,
        dst_block_ids: list[int],
        timeout_s: float,
        on_segment,
    ) -> TransferResult:
        """A pushed transfer: one rank to one always (the config refuses streamed KV on
        tensor-parallel pools), so the transport's own receiver follows it."""
        start = time.monotonic()
        result = self.direct.follow(
            source, request_id, first_block, dst_block_ids, timeout_s, on_segment
        )
        return self._count(result, start)

    def cancel(self, request_id: str) -> None:
        self.direct.cancel(request_id)

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        """Every sender rank's lease is kept, not only rank 0's: each rank's export is
        pulled by some receiver rank."""
        return all(self.direct.keepalive(part, timeout_s) for part in ticket.slices)

    def stats(self) -> ReceiverStats:
        with self._lock:
            return dataclasses.replace(
                self._stats,
                failures=dict(self._stats.failures),
                by_transport=dict(self._stats.by_transport),
            )

    def close(self) -> None:
        self.direct.close()
        for area in self.areas.values():
            area.close()
