"""The driver's side of the decode workers' event channels (decode_worker/event_channel.py).

One subscription per decode worker incarnation carries the events of every request this
driver runs there, a batch per engine step; each request reads its own events from a
queue here. When a subscription breaks (the worker died, or ended the stream), every
request reading from it gets the failure, as its own stream would have raised it.

A request's queue is bounded by backpressure, not by dropping: once it holds
`HOLD_AT` events (its reader, a slow streaming client, fell behind), the worker is
told to hold the request out of its batches, and once the reader has taken it down to
`RESUME_AT`, to let it go on. At most a step or two in flight lands past the mark.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator

from cluster.control.worker_info import WorkerInfo
from worker.messages import DecodeRequest

HOLD_AT = 64
"""Events queued for one request at which its decode worker holds it."""
RESUME_AT = 16
"""Events left in a held request's queue at which it is let go on."""


class WorkerStreamClosed(RuntimeError):
    """A decode worker ended its subscription stream while requests still read from it
    (it is shutting down): a worker failure, handled as its death."""


class _Subscription:
    """One worker incarnation's stream, read by a task that fans its batches out."""

    def __init__(self, handle, subscriber: str, worker_id: str):
        self.handle = handle
        self.worker_id = worker_id
        self.queues: dict[str, asyncio.Queue] = {}
        self.held: set[str] = set()
        """Requests this subscription asked the worker to hold (their readers are behind)."""
        self.holds = 0
        """Holds asked for over the subscription's life."""
        self.failure: BaseException | None = None
        stream = handle.subscribe.options(num_returns="streaming").remote(subscriber)
        self.reader = asyncio.get_running_loop().create_task(self._read(stream))

    async def _read(self, stream) -> None:
        try:
            async for ref in stream:
                for request_id, event in await ref:
                    queue = self.queues.get(request_id)
                    if queue is not None:  # else its reader left (closed, timed out)
                        queue.put_nowait(event)
                        if queue.qsize() >= HOLD_AT and request_id not in self.held:
                            self._hold(request_id, True)
            failure: BaseException = WorkerStreamClosed(f"{self.worker_id} closed its stream")
        except Exception as exc:  # the worker died (cancellation passes through)
            failure = exc
        self.failure = failure
        for queue in self.queues.values():
            queue.put_nowait(failure)

    def _hold(self, request_id: str, reader_behind: bool) -> None:
        """Tell the worker, without waiting (a dead worker's failure reaches the reader
        through the stream)."""
        if reader_behind:
            self.held.add(request_id)
            self.holds += 1
        else:
            self.held.discard(request_id)
        self.handle.hold.remote(request_id, reader_behind)

    def took(self, request_id: str, queue: asyncio.Queue) -> None:
        """The reader took an event off `queue`: a held request goes on once it caught up."""
        if request_id in self.held and queue.qsize() <= RESUME_AT:
            self._hold(request_id, False)


class StartedDecode:
    """One request's events on a decode worker, registered from the moment it was sent;
    iterate it once, and `close` it (idempotent) when done or never read."""

    def __init__(self, subscription: _Subscription, request_id: str, worker_id: str):
        self.subscription = subscription
        self.request_id = request_id
        self.worker_id = worker_id
        self.queue: asyncio.Queue = asyncio.Queue()
        subscription.queues[request_id] = self.queue

    async def __aiter__(self) -> AsyncIterator:
        subscription, queue = self.subscription, self.queue
        while (event := await queue.get()) is not None:  # None: it ended (aborted)
            if isinstance(event, BaseException):
                raise event
            subscription.took(self.request_id, queue)
            yield event

    def close(self) -> None:
        subscription = self.subscription
        if subscription.queues.get(self.request_id) is self.queue:
            del subscription.queues[self.request_id]
        subscription.held.discard(self.request_id)


class DecodeStreams:
    """One per `RequestFlow`; `events` is how the flow runs a request on a decode worker."""

    def __init__(self) -> None:
        self.subscriber = f"driver-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        """This driver's name on the workers: its channel there."""
        self.subscriptions: dict[str, _Subscription] = {}
        """Worker id -> the subscription to its current incarnation."""

    async def events(self, worker: WorkerInfo, request: DecodeRequest) -> AsyncIterator:
        """Send `request` to `worker` and yield its events (ImportEvent, TokenEvent,
        ErrorEvent) as they come. Raises the worker's failure (`RayActorError`, ...) if
        it dies first. Stops reading when the caller stops iterating; aborting the
        request on the worker is its owner's business (`ClusterRequest.close`)."""
        started = await self.start(worker, request)
        try:
            async for event in started:
                yield event
        finally:
            started.close()

    async def start(self, worker: WorkerInfo, request: DecodeRequest) -> StartedDecode:
        """Send `request` to `worker` now and return its events to read later (a streamed
        import starts before its prompt is prefilled, its events are read after)."""
        subscription = self._subscription(worker)
        started = StartedDecode(subscription, request.request_id, worker.worker_id)
        try:
            await worker.handle.decode.remote(request, self.subscriber)
        except BaseException:
            started.close()
            raise
        return started

    def close(self) -> None:
        """Cluster shutdown: stop reading every stream."""
        for subscription in self.subscriptions.values():
            subscription.reader.cancel()
        self.subscriptions.clear()

    def _subscription(self, worker: WorkerInfo) -> _Subscription:
        subscription = self.subscriptions.get(worker.worker_id)
        if (
            subscription is None
            or subscription.handle is not worker.handle
            or subscription.failure is not None
        ):
            subscription = _Subscription(worker.handle, self.subscriber, worker.worker_id)
            self.subscriptions[worker.worker_id] = subscription
        return subscription
