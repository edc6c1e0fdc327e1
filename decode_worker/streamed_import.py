"""A streamed import on a decode worker: the prompt's KV lands a segment at a time while
the prefill worker still computes the chunks after it.

Lifecycle (one per request sent with `kv_stream` PULL or PUSH):
    made with the request; the engine's import waits for blocks (the whole prompt's)
    -> `reserved(block_ids, held)`, engine thread: where each block goes, and how many
       leading ones the prefix cache already holds (never pulled)
    -> pull: segments come in (`add`, relayed by the driver) and are fetched in order,
       one at a time, on a fetch thread, each into its own blocks, each the moment it
       can be; push: one standing transfer from the prefill worker's sender
       (`KVReceiver.follow`), opened as soon as the blocks are reserved, lands each
       segment as the sender sends it
    -> `decided()`: the prefill's first token is known (it came with the final segment,
       or after it)
    -> settled exactly once (`settle(self)`): every block landed and the tokens known
       (ok); or a fetch failed, the stream was cut (its prefill worker died) or the
       request was cancelled: then the blocks that landed in order, each verified by its
       checksum, are kept (`landed`) and the rest is computed here.
The fetch thread is the only writer of the destination blocks, and settling waits until
no fetch runs, so the engine frees or reuses them only after the last byte landed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from engine import clock
from kv_transfer.base import (
    ExportTicket,
    FailureReason,
    KVReceiver,
    TransferResult,
    TransferState,
)
from worker.messages import StreamReceipt

logger = logging.getLogger(__name__)


class StreamedImport:
    """Shared by the worker's event loop (add, decided, cut), its engine thread (reserved,
    cancel) and one fetch thread at a time; every change is made under `lock`."""

    def __init__(
        self,
        request_id: str,
        receiver: KVReceiver,
        timeout_s: float,
        submit: Callable[[Callable[[], None]], None],
        settle: Callable[[StreamedImport], None],
        source: ExportTicket | None = None,
    ):
        self.request_id = request_id
        self.source = source
        """Push: the prefill worker's ticket of no blocks, which the standing transfer is
        opened from once the blocks are reserved (`KVReceiver.follow`); None: pull."""
        self.followed = False
        self.receiver = receiver
        self.timeout_s = timeout_s
        self._submit = submit
        """Runs a function on a fetch thread."""
        self._settle = settle
        """Called once, from whichever thread ends the import (the worker posts it on)."""
        self.lock = threading.Lock()
        self.pending: list[ExportTicket] = []
        """Segments not yet pulled, in block order."""
        self.dst: list[int] | None = None
        self.held = 0
        self.landed = 0
        """Leading blocks of the prompt in place: the held ones, then each pulled segment."""
        self.total: int | None = None
        """Blocks of the whole export, known from the final segment."""
        self.final_at: float | None = None
        self.tokens_ready = False
        self.cut = False
        self.cancelled = False
        self.failure: TransferResult | None = None
        self.busy = False
        self.settled = False
        self.latest: ExportTicket | None = None
        """The newest segment's ticket: keepalives reach the sender through it."""
        self.fetches: list[tuple[float, float]] = []
        """(start, end) of each pull, on this worker's clock."""
        self.num_bytes = 0
        self.transport = receiver.name
        self.admission_s = 0.0
        """From the request's arrival until its blocks were reserved (the worker sets it)."""

    # --- what comes in ---------------------------------------------------------------

    def add(self, ticket: ExportTicket, now: float | None = None) -> None:
        """A segment to pull (kept in block order)."""
        with self.lock:
            if self.settled:
                return
            self.pending.append(ticket)
            self.pending.sort(key=lambda t: t.first_block or 0)
            self.latest = ticket
            if ticket.segment is not None and ticket.segment.final:
                self.total = ticket.segment.first_block + len(ticket.block_ids)
                self.final_at = clock.now() if now is None else now
        self._advance()

    def decided(self) -> None:
        """The tokens the prefill worker sampled are on the sequence now."""
        with self.lock:
            self.tokens_ready = True
        self._advance()

    def reserved(self, block_ids: list[int], held: int) -> None:
        """Engine thread: the import's blocks, `held` leading ones from the prefix cache."""
        with self.lock:
            self.dst = list(block_ids)
            self.held = self.landed = held
        self._advance()

    def cut_short(self) -> None:
        """The prefill worker died before the final segment: pull what is already known
        (a dead sender's pool file still serves it on shm; elsewhere the pull fails
        fast), keep what lands, and end."""
        with self.lock:
            self.cut = True
        self._advance()

    def cancel(self) -> None:
        """The request was aborted: the running pull fails at its next piece."""
        with self.lock:
            self.cancelled = True
            busy = self.busy
        if busy:
            self.receiver.cancel(self.request_id)
        self._advance()

    def discard(self) -> None:
        """The import ended before any block was reserved (abort, export lost): nothing
        will be pulled, and nothing settles."""
        with self.lock:
            self.settled = True

    # --- progress --------------------------------------------------------------------

    def _advance(self) -> None:
        """Start the next pull, or settle, whichever is due (or nothing)."""
        with self.lock:
            if self.settled or self.busy or self.dst is None:
                return
            ended = self.cancelled or self.failure is not None
            if not ended and self.source is not None and not self.followed:
                self.followed = self.busy = True
                work = self._follow
            elif not ended and self._next_locked() is not None:
                self.busy = True
                work = self._drain
            else:
                done = self.total is not None and self.landed >= self.total
                if not (ended or (done and self.tokens_ready) or self.cut):
                    return
                self.settled, work = True, None
        if work is not None:
            self._submit(work)
        else:
            self._settle(self)

    def _next_locked(self) -> ExportTicket | None:
        """The next segment to pull, dropping those the held blocks already cover."""
        while self.pending:
            ticket = self.pending[0]
            first = ticket.first_block or 0
            if first > self.landed:
                return None  # a gap: an earlier segment has not come yet
            if first + len(ticket.block_ids) <= self.landed:
                self.pending.pop(0)  # wholly held by the prefix cache
                continue
            return ticket
        return None

    def _drain(self) -> None:
        """Fetch thread: pull segments while there are any to pull, then hand back."""
        try:
            while True:
                with self.lock:
                    ticket = None if self.cancelled else self._next_locked()
                    if ticket is None:
                        self.busy = False
                        break
                    first = ticket.first_block or 0
                    skip = self.landed - first
                    dst = self.dst[self.landed : first + len(ticket.block_ids)]
                if not self._pull(ticket.tail(skip) if skip else ticket, dst):
                    break
        except BaseException:
            with self.lock:
                self.busy = False
            raise
        finally:
            self._advance()

    def _follow(self) -> None:
        """Fetch thread (push): the standing transfer, from the first block not held."""
        try:
            first = self.landed
            try:
                result = self.receiver.follow(
                    self.source,
                    self.request_id,
                    first,
                    self.dst[first:],
                    self.timeout_s,
                    self._pushed,
                )
            except Exception as exc:  # a bug, not a transfer failure: the request must end
                logger.exception("[request %s] push transfer raised", self.request_id)
                result = self._raised(exc)
            with self.lock:
                self.transport = result.transport
                if result.ok:
                    self.total = len(self.dst)  # complete: every reserved block is in
                    self.final_at = self.final_at or clock.now()
                else:
                    self.failure = result
        finally:
            with self.lock:
                self.busy = False
            self._advance()

    def _raised(self, exc: Exception) -> TransferResult:
        return TransferResult(
            self.request_id,
            TransferState.FAILED,
            self.receiver.name,
            reason=FailureReason.INTERNAL,
            message=f"{type(exc).__name__}: {exc}",
        )

    def _pushed(self, ticket: ExportTicket, arrived: float, landed: float, nbytes: int) -> None:
        """A pushed segment landed, verified (on the fetch thread running `_follow`)."""
        with self.lock:
            self.fetches.append((arrived, landed))
            self.num_bytes += nbytes
            self.landed = ticket.first_block + len(ticket.block_ids)
            self.latest = ticket
            if ticket.segment.final:
                self.final_at = arrived

    def _pull(self, ticket: ExportTicket, dst: list[int]) -> bool:
        started = clock.now()
        try:
            result = self.receiver.fetch(ticket, dst, self.timeout_s)
        except Exception as exc:  # a bug, not a transfer failure: the request must end
            logger.exception("[request %s] segment fetch raised", self.request_id)
            result = self._raised(exc)
        ended = clock.now()
        with self.lock:
            self.fetches.append((started, ended))
            self.transport = result.transport
            if not result.ok:
                self.failure = result
                self.busy = False
                return False
            self.num_bytes += result.num_bytes
            self.landed = (ticket.first_block or 0) + len(ticket.block_ids)
            self.pending.pop(0)
        return True

    def keepalive_ticket(self) -> ExportTicket | None:
        """What a keepalive of the export goes through while the import waits for blocks:
        the newest segment's ticket; push, once the prefill is done, the source's under
        the request's id (before that the export may not exist yet: its growth keeps it)."""
        with self.lock:
            if self.latest is not None:
                return self.latest
            if self.source is not None and self.tokens_ready:
                return replace(self.source, request_id=self.request_id)
            return None

    # --- the outcome -----------------------------------------------------------------

    @property
    def sender_lost(self) -> bool:
        """The stream was cut by its sender's death (told by the driver, or seen first by
        a pull or the standing transfer): the rest is computed here, whatever the policy."""
        failure = self.failure
        return self.cut or (failure is not None and failure.reason == FailureReason.PEER_DIED)

    @property
    def ok(self) -> bool:
        return (
            self.failure is None
            and not self.cancelled
            and self.total is not None
            and self.landed >= self.total
            and self.tokens_ready
        )

    @property
    def seconds(self) -> float:
        """Time spent pulling (the fetches' sum): what the link cost, hidden or not."""
        return sum(end - start for start, end in self.fetches)

    def receipt(self) -> StreamReceipt:
        """What overlapped, on this worker's clock: pulls before the final segment's
        arrival were hidden behind the prefill's compute; the rest was exposed."""
        final = self.final_at
        if final is None:  # cut or failed before the end: nothing came after a final one
            hidden, exposed = self.seconds, 0.0
        else:
            hidden = sum(min(end, final) - start for start, end in self.fetches if start < final)
            last_end = max((end for _, end in self.fetches), default=final)
            exposed = max(0.0, last_end - final)
        first_end = self.fetches[0][1] if self.fetches else None
        before = final - first_end if final is not None and first_end is not None else None
        return StreamReceipt(
            segments=len(self.fetches),
            hidden_s=hidden,
            exposed_s=exposed,
            first_landed_before_final_s=before,
            first_landed_at=first_end,
            kept_blocks=0 if self.ok else self.landed,
            cut=self.sender_lost,
        )
