"""How a disaggregated request's KV reaches its decode worker, as the driver runs it.

`whole` (`kv_streaming: whole`, `kv_transfer_mode: pull`): the prefill call returns the
export's ticket, which the decode request carries (the request flow's plain path).
Streamed (`kv_streaming: chunk`, or push), for one request:
    `prefill` sends the decode request first, with no ticket (`DecodeRequest.kv_stream`):
      the decode worker's import reserves the prompt's blocks at once
    -> pull: `prefill_streamed` yields each prefill chunk's segment as its step ends,
       relayed at once (`DecodeWorker.stream_update`), the decode worker pulling each;
       push: a plain prefill call, the segments going from the prefill worker's sender
       down the transfer the decode worker opened
    -> the reply (first token, final segment) is relayed too: the import completes once
       every block and the first token are there; the request flow reads the decode
       request's events afterwards (`ClusterRequest.started_decode`)
    -> a prefill worker's death mid-stream: `cut`, the decode worker keeps what landed.
A request falls back to `whole` when streaming is off, it has no live decode worker
picked, or sending its decode request failed (the decode phase then picks again).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.config import ClusterConfig
from cluster.control.worker_info import WorkerInfo
from cluster.flow.decode_streams import DecodeStreams, WorkerStreamClosed
from cluster.flow.request import ClusterRequest, RequestFailedError
from worker.messages import (
    DecodeRequest,
    ErrorEvent,
    KVStream,
    PrefillRequest,
    PrefillResult,
    SegmentPublished,
    StreamUpdate,
)

_DECODE_FAILURES = (RayActorError, ActorUnavailableError, WorkerStreamClosed)


class KVDelivery:
    """One per request flow. `kv_stream` and `per_chunk` may be switched between
    requests (the bandwidth sweep compares the modes on one cluster; tests do too)."""

    def __init__(self, config: ClusterConfig, streams: DecodeStreams):
        self.kv_stream = config.kv_stream
        """How prompts' KV moves (`KVStream`): whole and pulled, segments pulled, pushed."""
        self.per_chunk = config.kv_streaming == "chunk"
        """Pushed exports: a segment per prefill chunk (else one, after the prompt)."""
        self.streams = streams
        self._relays: set[asyncio.Task] = set()
        """Stream updates on their way to decode workers (held until they land)."""
        self._push_sources: dict[tuple[str, int], object] = {}
        """(prefill worker, incarnation) -> its ticket of no blocks (push's start)."""

    async def prefill(
        self,
        req: ClusterRequest,
        worker: WorkerInfo,
        prefill_request: Callable[[ClusterRequest, KVStream, bool], PrefillRequest],
    ) -> PrefillResult | ErrorEvent:
        """The prefill call on `worker`, streamed or not; raises what the call raises
        (the prefill worker's failure)."""
        stream = await self._start_decode(req, worker)
        request = prefill_request(req, stream, self.per_chunk)
        if stream == KVStream.WHOLE:
            return await worker.handle.prefill.remote(request)
        req.timeline.kv_stream = stream.value
        decode = req.started_decode_worker
        reply = None
        if stream == KVStream.PULL:
            items = worker.handle.prefill_streamed.options(num_returns="streaming").remote(request)
            async for ref in items:
                item = await ref
                if isinstance(item, SegmentPublished):
                    self._relay(decode, StreamUpdate(req.request_id, item.ticket))
                else:
                    reply = item
        else:
            reply = await worker.handle.prefill.remote(request)
        if reply is None:
            raise RequestFailedError(req.request_id, "internal", "prefill stream ended early")
        if isinstance(reply, PrefillResult) and reply.ticket is not None:
            first = reply.first
            segment = reply.segment if stream == KVStream.PULL else None
            update = StreamUpdate(req.request_id, segment, list(first.token_ids), len(first.text))
            self._relay(decode, update)
        return reply

    def cut(self, req: ClusterRequest) -> None:
        """The request's prefill worker died mid-stream: its decode worker keeps the
        segments that landed and computes the rest."""
        self._relay(req.started_decode_worker, StreamUpdate(req.request_id, cut=True))

    async def _start_decode(self, req: ClusterRequest, prefill: WorkerInfo) -> KVStream:
        """Send the decode request ahead of the prefill when this request's KV streams;
        returns how it moves (`WHOLE` when it does not stream)."""
        stream = self.kv_stream
        pick = req.decode_pick
        if stream == KVStream.WHOLE or pick is None or not pick.worker.alive:
            return KVStream.WHOLE
        decode = pick.worker
        push_from = await self._push_source(prefill) if stream == KVStream.PUSH else None
        request = DecodeRequest(
            req.request_id,
            req.prompt_ids,
            [],
            req.params,
            0,
            None,
            req.timeline.arrival,
            kv_stream=stream,
            push_from=push_from,
        )
        sent = time.monotonic()
        try:
            req.started_decode = await self.streams.start(decode, request)
        except _DECODE_FAILURES:
            return KVStream.WHOLE  # the decode phase finds it dead and picks again
        req.hold(decode)
        req.started_decode_worker, req.started_decode_at = decode, sent
        return stream

    async def _push_source(self, prefill: WorkerInfo):
        """The prefill worker's ticket of no blocks (endpoint, layout, checksum algorithm):
        what a push import opens its transfer with. Asked once per incarnation."""
        key = (prefill.worker_id, prefill.generation)
        source = self._push_sources.get(key)
        if source is None:
            source = await prefill.handle.push_source.remote()
            self._push_sources[key] = source
        return source

    def _relay(self, decode: WorkerInfo, update: StreamUpdate) -> None:
        """Hand a stream update to the decode worker without waiting; a dead one's
        failure reaches the request through its events."""
        task = asyncio.ensure_future(_settled_quietly(decode.handle.stream_update.remote(update)))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)


async def _settled_quietly(ref) -> None:
    """Await a relay's result so that a dead worker's error is not logged as unhandled."""
    with contextlib.suppress(Exception):
        await ref
