"""The decode worker: a Ray actor that imports KV and streams tokens.

Lifecycle of a request here (`decode`; its events travel in the driver's `subscribe`
stream, batched per step with its other requests' events):
    with a ticket: `begin_import` makes the sequence IMPORTING in the engine, where it
      waits (abortably) for free blocks while the sender's lease is kept alive
    -> the engine thread reserves its blocks and starts the transfer on a fetch
       thread, which writes straight into them (the leading blocks this worker's
       prefix cache already holds are shared, not pulled: the pull asks for the
       rest only, and with none missing nothing moves); when the bytes stop landing, the
       engine thread settles the import (`finish_import`) and streams an ImportEvent
    -> on failure: `on_transfer_failure: recompute` prefills the prompt here into the
       same blocks, or `fail` ends the request with an ErrorEvent
    streamed (`kv_stream` PULL or PUSH, decode_worker/streamed_import.py): sent before
      the prompt is prefilled, with no ticket; the import reserves its blocks at once
      and pulls each segment as it comes (`stream_update` relays them, pull; the
      standing transfer brings them, push); it completes once every block landed and
      the prefill's first token came (`stream_update`), or keeps what landed and
      computes the rest here when the stream was cut (its prefill worker died)
    without a ticket (colocated, recovery, decode-side prefill): prefilled here
    -> READY, then a seat in the continuous decode batch (at most `max_num_seqs`);
       each step's token is yielded to the caller as it is made
    -> finish (stop/length) or abort (the caller went away): blocks back to the pool.
The blocks of an import are only ever freed on the engine thread, after the
transfer stopped writing, whatever the caller does meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from decode_worker.event_channel import EventBatch, EventChannels
from decode_worker.streamed_import import StreamedImport
from engine import clock
from engine.engine_loop import EngineLoop
from engine.errors import RequestAbortedError
from engine.llm_engine import LLMEngine
from worker.actor import EngineActor
from worker.health import (
    StartupTimer,
    engine_state,
    health_report,
)
from worker.kv_shards import ShardedReceiver, make_rank_receiver
from worker.messages import (
    DecodeRequest,
    ErrorEvent,
    HealthReport,
    ImportEvent,
    KVStream,
    StreamUpdate,
    TokenEvent,
)
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

_KEEPALIVE_EVERY_S = 1.0
_FETCH_THREADS = 4
_LEASE_LOST = "unknown_request"
"""`FailureReason` value of an import whose export vanished while it waited for blocks."""


class DecodeWorker(EngineActor):
    """Instantiated as a named Ray actor by the controller; also the colocated worker."""

    def _build(self, spec: WorkerSpec, timer: StartupTimer) -> None:
        self.spec = spec
        self.worker_id = spec.worker_id
        self.role = spec.role
        self.engine = self._make_engine(spec)
        timer.lap("engine_s")
        self.receiver = None
        if self.role == "decode":
            engine = self.engine
            self.receiver = make_rank_receiver(spec, 0, engine.kv_pool, engine.max_model_len)
            if self.ranks is not None:
                self.receiver = ShardedReceiver(self.receiver, self.ranks.followers)
        timer.lap("transport_s")
        self.startup = timer.durations
        self.fetch_pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="kv-fetch")
        self.tickets: dict[str, object] = {}
        """Tickets of imports still waiting for blocks, read by the engine thread."""
        self.streamed: dict[str, StreamedImport] = {}
        """Streamed imports not yet settled."""
        self.last_transfer: dict[str, str] = {}
        """Prefill worker -> how its last request's KV got here (transport or recomputed)."""
        self.channels = EventChannels()
        """Per subscriber (a driver): the channel its requests' events travel in."""

    def _make_loop(self) -> EngineLoop:
        return EngineLoop(
            self.engine, on_iteration=self._start_imports, on_abort=self._cancel_fetch
        )

    # --- the streams ------------------------------------------------------------------

    async def subscribe(self, subscriber: str) -> AsyncIterator[EventBatch]:
        """Streaming call, one per driver (`subscriber`) and worker incarnation, from the
        driver's `DecodeStreams`: the events of every request that driver sent here
        (`decode`), as one batch per step. When the stream ends (the driver went away or
        dropped it), its requests still running here are aborted."""
        channel = self.channels.for_subscriber(subscriber)
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            self.channels.ended(subscriber, channel)

    async def decode(self, request: DecodeRequest, subscriber: str) -> None:
        """Called by the driver's request flow, once per request sent here: returns once
        the request is taken; its events then travel in `subscriber`'s stream: an
        ImportEvent first when a ticket was given, then one TokenEvent per step, ending
        with a finished TokenEvent, an ErrorEvent, or nothing after an abort."""
        self.channels.for_request(subscriber).forward(request.request_id, self._events(request))

    async def hold(self, request_id: str, reader_behind: bool) -> None:
        """Called by the driver's `DecodeStreams` when its queue of the request's events
        filled up (True) and again once it drained (False): the engine holds the
        sequence out of its batches meanwhile, so a slow reader slows its own stream
        and no queue of its tokens grows."""
        self._engine_loop().post(lambda engine: engine.hold(request_id, reader_behind))

    async def _events(
        self, request: DecodeRequest
    ) -> AsyncIterator[ImportEvent | TokenEvent | ErrorEvent]:
        loop = self._engine_loop()
        request_id = request.request_id
        stream = loop.open_stream(request_id)
        finished = False
        try:
            if request.ticket is not None or request.kv_stream != KVStream.WHOLE:
                event = await self._import(request, stream)
                yield event
                cut = event.stream is not None and event.stream.cut
                if not event.ok and not cut and self.spec.on_transfer_failure == "fail":
                    yield ErrorEvent(request_id, "transfer_failed", event.message)
                    return
            else:
                await loop.call(lambda e: self._prefill_here(e, request))
            while not finished:
                output = await stream.get()
                if output is None:  # aborted by the request's owner
                    return
                finished = output.finished
                yield output
        except Exception as exc:  # the request failed, not the worker: say so in the stream
            if not isinstance(exc, RequestAbortedError):
                logger.warning("[request %s] decode failed: %r", request_id, exc)
            yield ErrorEvent.of(request_id, exc)
        finally:
            self.tickets.pop(request_id, None)
            loop.close_stream(request_id)
            if not finished:
                loop.abort(request_id)

    @staticmethod
    def _prefill_here(engine: LLMEngine, r: DecodeRequest) -> None:
        """Compute the KV of prompt + decided tokens here (colocated, recovery, recompute)."""
        engine.add_request(
            r.request_id,
            r.prompt_token_ids,
            r.params,
            output_token_ids=r.output_token_ids,
            emitted_text_len=r.emitted_text_len,
            priority=r.arrival,
        )

    async def _import(self, r: DecodeRequest, stream: asyncio.Queue) -> ImportEvent:
        """Announce the import and wait for its outcome, keeping the sender's lease alive
        while the sequence waits for blocks."""
        loop = self._engine_loop()
        if r.kv_stream != KVStream.WHOLE:
            imported = self._open_streamed(r)
        else:
            self.tickets[r.request_id] = r.ticket
        await loop.call(
            lambda e: e.begin_import(
                r.request_id,
                r.prompt_token_ids,
                r.output_token_ids,
                r.params,
                len(r.prompt_token_ids) if r.ticket is None else r.ticket.num_tokens,
                emitted_text_len=r.emitted_text_len,
                priority=r.arrival,
            )
        )
        while True:
            try:
                item = await asyncio.wait_for(stream.get(), _KEEPALIVE_EVERY_S)
            except asyncio.TimeoutError:
                ticket = r.ticket if r.kv_stream == KVStream.WHOLE else imported.keepalive_ticket()
                if ticket is None:
                    continue  # no segment yet: the export's lease is kept by its growth
                lost = await self._export_lost(r.request_id, ticket)
                if lost is not None:
                    self._discard_streamed(r.request_id)
                    return lost
                continue
            if item is None:
                raise RequestAbortedError("aborted while importing", r.request_id)
            assert isinstance(item, ImportEvent), item
            return item

    def _open_streamed(self, r: DecodeRequest) -> StreamedImport:
        """The streamed import of `r`, fed by `stream_update` (and, push, its transfer)."""
        imported = StreamedImport(
            r.request_id,
            self.receiver,
            self.spec.transport_options.timeout_s,
            lambda fn: self.fetch_pool.submit(fn),
            lambda done: self.loop.post(lambda e: self._settle_streamed(e, done)),
            r.push_from if r.kv_stream == KVStream.PUSH else None,
        )
        self.streamed[r.request_id] = imported
        return imported

    def _discard_streamed(self, request_id: str) -> None:
        imported = self.streamed.pop(request_id, None)
        if imported is not None:
            imported.discard()

    async def stream_update(self, update: StreamUpdate) -> None:
        """Called by the driver for a request sent with a streamed `kv_stream`: a segment
        to pull at once (pull), the prefill's first token (with the final segment, pull),
        or the news that the stream was cut (its prefill worker died). Updates for a
        request whose import already ended are ignored."""
        arrived = clock.now()
        imported = self.streamed.get(update.request_id)
        if imported is None:
            return
        if update.cut:
            imported.cut_short()
            return
        if update.segment is not None:
            imported.add(update.segment, arrived)  # its pull starts before the rest below
        if update.output_token_ids is not None:
            request_id, tokens = update.request_id, update.output_token_ids
            text_len = update.emitted_text_len
            await self._engine_loop().call(lambda e: e.resume_with(request_id, tokens, text_len))
            imported.decided()

    def _settle_streamed(self, engine: LLMEngine, imported: StreamedImport) -> None:
        """Engine thread: the streamed import ended (no pull runs any more)."""
        request_id = imported.request_id
        self.streamed.pop(request_id, None)
        seq = engine.sequences.get(request_id)
        if seq is None or not seq.block_ids:
            return  # dropped before its blocks were reserved: nothing landed
        recompute = imported.sender_lost or self.spec.on_transfer_failure == "recompute"
        size = engine.config.block_size
        engine.finish_import(request_id, imported.ok, recompute, imported.landed * size)
        failure = imported.failure
        reason, message = _stream_failure(imported)
        sender = imported.latest.sender_id if imported.latest is not None else "?"
        fallback = "recomputed" if recompute else "failed"
        self.last_transfer[sender] = imported.transport if imported.ok else fallback
        event = ImportEvent(
            imported.ok,
            failure.transport if failure is not None else imported.transport,
            imported.num_bytes,
            reason,
            message,
            imported.admission_s,
            imported.seconds,
            self.worker_id,
            reused_blocks=imported.held,
            moved_blocks=imported.landed - imported.held,
            stream=imported.receipt(),
        )
        self.loop.deliver(request_id, event)

    async def _export_lost(self, request_id: str, ticket) -> ImportEvent | None:
        """Keepalive of a waiting import. When the export is gone (lease expired, sender
        died) and no transfer started yet, the import ends here: an ImportEvent that
        says so, after the sequence was set to recompute or dropped per the policy."""
        if await asyncio.to_thread(self.receiver.keepalive, ticket):
            return None
        recompute = self.spec.on_transfer_failure == "recompute"
        cancelled = await self._engine_loop().call(lambda e: e.cancel_import(request_id, recompute))
        if not cancelled:
            return None  # a transfer is already under way; its outcome will come
        self.last_transfer[ticket.sender_id] = "recomputed" if recompute else "failed"
        message = f"[request {request_id}] export on {ticket.sender_id} is gone"
        return ImportEvent(
            False, self.receiver.name, 0, _LEASE_LOST, message, 0.0, 0.0, self.worker_id
        )

    # --- the engine thread ----------------------------------------------------------------

    def _start_imports(self, engine: LLMEngine) -> None:
        for seq in engine.reserve_imports():
            streamed = self.streamed.get(seq.request_id)
            if streamed is not None:
                streamed.admission_s = clock.now() - seq.arrival_time
                streamed.reserved(seq.block_ids, seq.num_cached_tokens // engine.config.block_size)
                continue
            ticket = self.tickets.pop(seq.request_id, None)
            if ticket is None:  # its stream closed meanwhile: nothing will be fetched
                engine.finish_import(seq.request_id, ok=False, recompute=False)
                continue
            admission_s = clock.now() - seq.arrival_time
            # The leading blocks the prefix cache already holds are not pulled: the pull
            # names only the missing ones (the export's tail).
            held = seq.num_cached_tokens // engine.config.block_size
            missing = list(seq.block_ids[held:])
            if not missing:
                self._finish_import(
                    engine, ticket, _nothing_to_move(ticket, self.receiver), admission_s, held
                )
                continue
            self.fetch_pool.submit(self._fetch, ticket, missing, held, admission_s)

    def _fetch(self, ticket, block_ids: list[int], held: int, admission_s: float) -> None:
        """On a fetch thread: move the bytes, then settle the import on the engine thread."""
        timeout_s = self.spec.transport_options.timeout_s
        result = self.receiver.fetch(ticket, block_ids, timeout_s, held_blocks=held)
        self.loop.post(lambda e: self._finish_import(e, ticket, result, admission_s, held))

    def _finish_import(
        self, engine: LLMEngine, ticket, result, admission_s: float, held: int = 0
    ) -> None:
        recompute = self.spec.on_transfer_failure == "recompute"
        engine.finish_import(ticket.request_id, result.ok, recompute)
        fallback = "recomputed" if recompute else "failed"
        self.last_transfer[ticket.sender_id] = result.transport if result.ok else fallback
        reason = result.reason.value if result.reason else None
        event = ImportEvent(
            result.ok,
            result.transport,
            result.num_bytes,
            reason,
            result.message,
            admission_s,
            result.seconds,
            self.worker_id,
            reused_blocks=held,
            moved_blocks=len(ticket.block_ids) - held if result.ok else 0,
            slices=tuple(result.slices),
        )
        self.loop.deliver(ticket.request_id, event)

    def _cancel_fetch(self, engine: LLMEngine, request_id: str) -> None:
        self.tickets.pop(request_id, None)
        seq = engine.sequences.get(request_id)
        streamed = self.streamed.get(request_id)
        if streamed is not None:
            if seq is not None and seq.abort_requested:
                streamed.cancel()  # settles once no pull runs; the engine then frees
            else:
                self._discard_streamed(request_id)  # dropped with no blocks reserved
            return
        if seq is not None and seq.abort_requested and self.receiver is not None:
            self.receiver.cancel(request_id)

    # --- control ------------------------------------------------------------------------

    async def check_health(self) -> HealthReport:
        """Called by the controller's watchdog; raises (or times out) when unhealthy."""
        transfer = self.receiver.stats() if self.receiver is not None else None
        return health_report(
            self.worker_id,
            self.role,
            self.engine,
            self._engine_loop(),
            transfer,
            self.last_transfer,
            self.startup,
            rank_pids=await self._rank_pids(),
        )

    async def debug_state(self) -> dict:
        """Leak checks in tests and drills: blocks in use, each request's state, and the
        streamed imports still open (request -> leading blocks landed)."""
        state = await self._engine_loop().call(engine_state)
        return {**state, "streams": {rid: s.landed for rid, s in self.streamed.items()}}

    async def shutdown(self) -> None:
        if self.spec is None:  # a prestarted process: nothing built
            self._stop_engine()
            return
        for channel in self.channels:
            channel.close()
        self._stop_engine()
        self.fetch_pool.shutdown(wait=False, cancel_futures=True)
        if self.receiver is not None:
            self.receiver.close()


def _stream_failure(imported: StreamedImport) -> tuple[str | None, str]:
    """(`FailureReason` value, message) of a streamed import that did not complete."""
    if imported.ok:
        return None, ""
    if imported.failure is not None:
        failure = imported.failure
        return failure.reason.value if failure.reason else "internal", failure.message
    request_id = imported.request_id
    if imported.cancelled:
        return "cancelled", f"[request {request_id}] cancelled while its KV streamed in"
    return "peer_died", (
        f"[request {request_id}] stream cut after {imported.landed} blocks: its prefill "
        "worker died; the rest is computed here"
    )


def _nothing_to_move(ticket, receiver):
    """The outcome of an import whose every block was a prefix-cache hit."""
    from kv_transfer.base import TransferResult, TransferState

    return TransferResult(ticket.request_id, TransferState.DONE, receiver.name)
