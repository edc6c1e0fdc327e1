"""The prefill worker: a Ray actor that runs prompts and exports their KV.

Lifecycle of a request here:
    prefill() called by the driver's request flow
    -> queued in the engine (batched with other prompts up to the token budget,
       chunked when longer than the prefill chunk)
    -> first token sampled; the sequence is PREFILLED, its blocks still the engine's
    -> right after that step, still on the engine thread and before the next step,
       `export_prefilled` hands the blocks to the KV sender under a lease (an abort
       cannot slip in between; a failed export frees them). Exporting from the
       event loop instead let the next step start first, so a batch's first tokens
       waited for the next batch's whole prefill
    -> the ticket goes back to the caller, which hands it to a decode worker
    -> ack (decode imported them), abort, or lease expiry returns the blocks.
`abort()` ends the request at any of these points: queued, prefilling, exported.

A streamed request (`kv_stream` PULL or PUSH, prefill_worker/segments.py) is exported
a segment at a time instead, right after each of its prefill chunks' steps; with PULL
each segment's ticket goes to the caller as it is made (`prefill_streamed`), and the
step that samples the first token exports the final segment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine import clock
from engine.engine_loop import EngineLoop
from engine.errors import RequestAbortedError
from engine.llm_engine import LLMEngine
from engine.sequence import SequenceOutput
from kv_transfer.endpoints import SenderEndpoint
from prefill_worker.segments import SegmentPublisher
from worker.actor import EngineActor
from worker.health import (
    StartupTimer,
    engine_state,
    health_report,
)
from worker.kv_shards import ShardedSender, make_rank_sender
from worker.messages import (
    ErrorEvent,
    HealthReport,
    KVStream,
    PrefillRequest,
    PrefillResult,
    SegmentPublished,
)
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Exported:
    """What a prefilled sequence's stream gets: its first token and its export, made on
    the engine thread right after the step that sampled the token."""

    request_id: str
    output: SequenceOutput
    ticket: object | None
    error: Exception | None
    exported_at: float
    segment: object | None = None
    """A streamed export's final segment."""
    segments: int = 0
    """Segments the streamed export went out in."""


class PrefillWorker(EngineActor):
    """Instantiated as a named Ray actor by the controller (one per prefill slot)."""

    def _build(self, spec: WorkerSpec, timer: StartupTimer) -> None:
        self.spec = spec
        self.worker_id = spec.worker_id
        self.engine = self._make_engine(spec)
        timer.lap("engine_s")
        self.sender = make_rank_sender(spec, 0, self.engine.kv_pool)
        if self.ranks is not None:
            self.sender = ShardedSender(self.sender, self.ranks.followers)
        timer.lap("transport_s")
        self.startup = timer.durations
        self._last_state: dict | None = None
        """The engine state `debug_state` read last."""
        self.peers: dict[str, str] = {}
        """Request -> the decode worker its export is meant for, until it is exported."""
        self.segments = SegmentPublisher(self.sender, spec.engine.block_size)
        """Streamed requests' exports, grown after each step (engine thread only)."""

    def _make_loop(self) -> EngineLoop:
        return EngineLoop(
            self.engine,
            on_iteration=self._free_released,
            on_abort=self._release_export,
            on_outputs=self._export_prefilled,
            track_stepping=True,  # `debug_state` answers during a step
            on_step=self._publish_segments,
        )

    def _publish_segments(self, engine: LLMEngine) -> None:
        """After each step: export what the streamed requests' chunks completed."""
        if not self.segments.streams:
            return
        for request_id, ticket in self.segments.after_step(engine):
            self.loop.deliver(request_id, SegmentPublished(request_id, ticket))

    def _free_released(self, engine: LLMEngine) -> None:
        for block_ids in self.sender.poll_released():
            engine.release_blocks(block_ids)

    def _release_export(self, _engine: LLMEngine, request_id: str) -> None:
        # An abort after the export (or mid-stream): the lease lets go now, not at expiry.
        self.peers.pop(request_id, None)
        self.segments.close(request_id)
        self.sender.abort(request_id)

    def _export_prefilled(self, engine: LLMEngine, outputs: list) -> list:
        """On the engine thread, right after a step: export every sequence it prefilled."""
        delivered = []
        for output in outputs:
            request_id = output.request_id
            streamed = self.segments.streaming(request_id)
            if not output.prefilled:
                if streamed:  # finished at its first token: its segments go back
                    self.segments.close(request_id)
                    self.sender.abort(request_id)
                delivered.append(output)  # nothing to export
                continue
            peer = self.peers.pop(request_id, "")
            segment, segments = None, 0
            try:
                if streamed:
                    ticket, segment = self.segments.export_final(engine, request_id)
                    segments = self.segments.segments(request_id)
                    self.segments.close(request_id)
                else:
                    ticket = engine.export_prefilled(request_id, self._exporter(peer))
                error = None
            except Exception as exc:  # the blocks are back; the request fails, not the worker
                ticket, error = None, exc
                if streamed:
                    self.segments.close(request_id)
                    self.sender.abort(request_id)
            exported = _Exported(request_id, output, ticket, error, clock.now(), segment, segments)
            delivered.append(exported)
        return delivered

    async def prefill(self, request: PrefillRequest) -> PrefillResult | ErrorEvent:
        """Called once per request by the driver's request flow (whole exports, and push,
        whose segments go out through the sender). Errors come back as an `ErrorEvent`
        (never raised), so the driver can tell a bad request from a dead worker."""
        last = None
        async for item in self._prefill_items(request):
            last = item
        return last

    async def prefill_streamed(self, request: PrefillRequest):
        """Streaming call (`KVStream.PULL`), once per request: a `SegmentPublished` for
        each prefill chunk's segment as soon as its step ends, then what `prefill`
        returns (the final segment in it)."""
        async for item in self._prefill_items(request):
            yield item

    async def _prefill_items(self, request: PrefillRequest):
        loop = self._engine_loop()
        request_id = request.request_id
        arrived = clock.now()
        stream = loop.open_stream(request_id)
        self.peers[request_id] = request.peer_id
        if request.kv_stream != KVStream.WHOLE:
            relay = request.kv_stream == KVStream.PULL
            per_chunk = relay or request.per_chunk
            await loop.call(
                lambda e: self.segments.open(request_id, request.peer_id, relay, per_chunk)
            )
        try:
            seq = await loop.call(
                lambda e: e.add_request(
                    request_id,
                    request.prompt_token_ids,
                    request.params,
                    stop_after_prefill=True,
                    priority=request.arrival,
                )
            )
            while isinstance(item := await stream.get(), SegmentPublished):
                yield item
            if item is None:
                raise RequestAbortedError("aborted during prefill", request_id)
            output, exported = item, None
            if isinstance(item, _Exported):
                if item.error is not None:
                    raise item.error
                output, exported = item.output, item
        except Exception as exc:  # the request failed, not the worker: say so in data
            if not isinstance(exc, RequestAbortedError):
                logger.warning("[request %s] prefill failed: %r", request_id, exc)
            yield ErrorEvent.of(request_id, exc)
            return
        finally:
            loop.close_stream(request_id)
            self.peers.pop(request_id, None)
            loop.post(lambda e: self.segments.close(request_id))
        yield self._result(request_id, seq, arrived, output, exported)

    def _result(self, request_id: str, seq, arrived: float, output, exported) -> PrefillResult:
        scheduled = seq.first_scheduled_at or arrived
        first_token = seq.first_token_at or scheduled
        return PrefillResult(
            request_id=request_id,
            worker_id=self.worker_id,
            first=output,
            num_prompt_tokens=output.num_prompt_tokens,
            ticket=exported.ticket if exported is not None else None,
            queue_s=scheduled - arrived,
            prefill_s=first_token - scheduled,
            export_s=exported.exported_at - first_token if exported is not None else 0.0,
            segment=exported.segment if exported is not None else None,
            segments=exported.segments if exported is not None else 0,
        )

    def _exporter(self, peer_id: str):
        def export(seq):
            return self.sender.export(seq.request_id, seq.block_ids, seq.num_prompt_tokens, peer_id)

        return export

    async def ack(self, request_id: str) -> None:
        """Called after the decode worker imported the KV: the blocks can go back."""
        self.sender.ack(request_id)

    async def check_health(self) -> HealthReport:
        """Called by the controller's watchdog; raises (or times out) when unhealthy."""
        return health_report(
            self.worker_id,
            "prefill",
            self.engine,
            self._engine_loop(),
            self.sender.stats(),
            startup=self.startup,
            rank_pids=await self._rank_pids(),
        )

    async def debug_state(self) -> dict:
        """Leak checks in tests and drills: blocks in use, leases outstanding (and those
        whose bytes this worker's death would lose), and each request's state (read on
        the engine thread, which owns them). During a step it answers at once: the last
        state read, with the requests the step holds. Waiting for a long prefill step to
        end, a drill saw each prompt only after it was exported, when killing this
        worker cost it nothing."""
        loop = self._engine_loop()
        if loop.stepping is not None and self._last_state is not None:
            stepping = loop.stepping
            state = {**self._last_state, "requests": stepping, "sequences": len(stepping)}
        else:
            state = self._last_state = await loop.call(engine_state)
        leases = self.sender.leased_request_ids()
        rank_leases = []
        if isinstance(self.sender, ShardedSender):
            rank_leases = await self.sender.follower_leases()
        return {
            **state,
            "outstanding_leases": len(leases) + sum(map(len, rank_leases)),
            "leases": leases,
            "rank_leases": rank_leases,
            "exports_at_risk": self.sender.at_risk_request_ids(),
            "streams": {rid: s.published for rid, s in list(self.segments.streams.items())},
        }

    async def endpoint(self) -> SenderEndpoint:
        return self.sender.endpoint()

    async def push_source(self):
        """Called by the driver once per incarnation (`kv_transfer_mode: push`): the ticket
        of no blocks a decode worker opens its standing transfer with (this sender's
        endpoint, layout, checksum algorithm and lease)."""
        return self.sender.push_source()

    async def shutdown(self) -> None:
        self._stop_engine()
        if self.spec is not None:
            self.sender.close()
