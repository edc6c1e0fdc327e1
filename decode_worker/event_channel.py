"""One driver's events on a decode worker, sent in batches: one Ray message per step.

A Ray streaming call costs about half a millisecond of CPU per item on each side (the
item is an object put, a report to the owner and a get); one stream per request made
that a per-token cost, paid on the cores the engine's OpenMP team needs. So a driver
subscribes once per worker (`DecodeWorker.subscribe`), and every request it sends
there (`DecodeWorker.decode`) puts its events into the driver's channel. The engine
loop hands a step's outputs to the event loop in one callback, which wakes every
request's forwarder in the same pass; the channel's reader runs after them and sends
what they put as one batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

logger = logging.getLogger(__name__)

EventBatch = list[tuple[str, Any]]
"""(request id, ImportEvent | TokenEvent | ErrorEvent | None) pairs, in the order they
were made; None ends a request's events when nothing else did (it was aborted)."""


class EventChannel:
    """Created by the first `decode` or `subscribe` of a driver; gone with its stream."""

    def __init__(self) -> None:
        self.pending: EventBatch = []
        self.ready = asyncio.Event()
        self.forwarders: dict[str, asyncio.Task] = {}
        """Request id -> the task that feeds its events in (`forward`)."""
        self.closed = False
        self.read = False
        """A subscription stream has started reading it (`batches`)."""

    def forward(self, request_id: str, events: AsyncIterator[Any]) -> None:
        """Feed `events` (one request's) into the channel on a task of its own."""
        self.forwarders[request_id] = asyncio.get_running_loop().create_task(
            self._forward(request_id, events)
        )

    async def batches(self) -> AsyncIterator[EventBatch]:
        """What the subscription stream yields: every event put since the last batch."""
        self.read = True
        while not self.closed:
            await self.ready.wait()
            self.ready.clear()
            batch, self.pending = self.pending, []
            if batch:
                yield batch

    def close(self) -> None:
        """The subscriber went away: its requests end here (each aborts on its way out)."""
        self.closed = True
        self.ready.set()  # `batches` ends: the subscription stream with it
        for task in self.forwarders.values():
            task.cancel()
        self.forwarders.clear()

    def _put(self, request_id: str, event: Any) -> None:
        self.pending.append((request_id, event))
        self.ready.set()

    async def _forward(self, request_id: str, events: AsyncIterator[Any]) -> None:
        try:
            async for event in events:
                self._put(request_id, event)
            self._put(request_id, None)
        finally:
            if self.forwarders.get(request_id) is asyncio.current_task():
                del self.forwarders[request_id]


UNREAD_GRACE_S = 30.0
"""How long a channel that a `decode` made may wait for its driver's subscription. A
driver subscribes before or just after its first request; a request that arrives after
its driver's stream ended (the driver died, or gave that incarnation up) would
otherwise run to its last token, holding KV blocks, in a channel nobody reads."""


class EventChannels:
    """A decode worker's channels by subscriber (driver), each made by the first
    `decode` or `subscribe` of its driver, removed when its stream ends, or closed when
    one made by a `decode` is still unread after `grace_s` (its requests abort)."""

    def __init__(self, grace_s: float = UNREAD_GRACE_S) -> None:
        self.grace_s = grace_s
        self._channels: dict[str, EventChannel] = {}

    def for_subscriber(self, subscriber: str) -> EventChannel:
        """Called by `DecodeWorker.subscribe`: the driver's channel, made if need be."""
        return self._channels.get(subscriber) or self._make(subscriber)

    def for_request(self, subscriber: str) -> EventChannel:
        """Called by `DecodeWorker.decode`: the driver's channel; a new one is closed
        unless a subscription reads it within `grace_s`."""
        channel = self._channels.get(subscriber)
        if channel is None:
            channel = self._make(subscriber)
            asyncio.get_running_loop().call_later(
                self.grace_s, self._drop_unread, subscriber, channel
            )
        return channel

    def ended(self, subscriber: str, channel: EventChannel) -> None:
        """The subscription stream reading `channel` ended: close it, forget it."""
        if self._channels.get(subscriber) is channel:
            del self._channels[subscriber]
        channel.close()

    def __iter__(self) -> Iterator[EventChannel]:
        return iter(list(self._channels.values()))

    def __len__(self) -> int:
        return len(self._channels)

    def _make(self, subscriber: str) -> EventChannel:
        channel = self._channels[subscriber] = EventChannel()
        return channel

    def _drop_unread(self, subscriber: str, channel: EventChannel) -> None:
        if channel.read or channel.closed:
            return
        logger.warning(
            "no subscription of %s read its events in %.0f s: aborting its %d requests",
            subscriber,
            self.grace_s,
            len(channel.forwarders),
        )
        self.ended(subscriber, channel)
