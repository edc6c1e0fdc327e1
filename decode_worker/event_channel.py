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
from collections.abc import AsyncIterator
from typing import Any

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

    def forward(self, request_id: str, events: AsyncIterator[Any]) -> None:
        """Feed `events` (one request's) into the channel on a task of its own."""
        self.forwarders[request_id] = asyncio.get_running_loop().create_task(
            self._forward(request_id, events)
        )

    async def batches(self) -> AsyncIterator[EventBatch]:
        """What the subscription stream yields: every event put since the last batch."""
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
