"""Drives an `LLMEngine` on a dedicated thread for async (Ray actor) callers.

The engine is synchronous and CPU-bound; running it on the actor's event loop would
stall health checks and streaming. So one thread owns the engine: it runs queued
commands between steps (add, abort, export...), steps while there is work, and hands
each step's outputs back to the event loop, where per-request queues feed streams.

Callers (the worker actors) use `call` to run a function on the engine thread and
`open_stream` / `close_stream` to receive a request's `SequenceOutput`s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine
from engine.sequence import SequenceOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineLoop:
    """One per worker process. Started in the actor's constructor, stopped at shutdown."""

    def __init__(self, engine: LLMEngine, on_iteration: Callable[[LLMEngine], None] | None = None):
        self.engine = engine
        self.on_iteration = on_iteration
        """Runs on the engine thread every iteration (e.g. free blocks released by transports)."""
        self.loop = asyncio.get_event_loop()
        self.commands: deque[tuple[Callable, asyncio.Future | None]] = deque()
        self.streams: dict[str, asyncio.Queue] = {}
        self.wakeup = threading.Event()
        self.running = True
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread; the future resolves with its result."""
        future = self.loop.create_future()
        self.commands.append((fn, future))
        self.wakeup.set()
        return future

    def open_stream(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        return queue

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def abort(self, request_id: str) -> asyncio.Future:
        """Abort on the engine thread and end the request's stream, if one is open."""
        queue = self.streams.get(request_id)
        if queue is not None:
            queue.put_nowait(None)
        return self.call(lambda e: e.abort(request_id))

    def stop(self) -> None:
        self.running = False
        self.wakeup.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while self.running:
            self._run_commands()
            if self.on_iteration:
                self.on_iteration(self.engine)
            if not self.engine.has_unfinished():
                self.wakeup.wait(_IDLE_WAIT_S)
                self.wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                logger.exception("engine step failed")
                raise
            if outputs:
                self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _run_commands(self) -> None:
        while self.commands:
            fn, future = self.commands.popleft()
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # handed to the awaiting caller, not lost
                result, error = None, exc
            if future is not None:
                self.loop.call_soon_threadsafe(_resolve, future, result, error)

    def _deliver(self, outputs: list[SequenceOutput]) -> None:
        for output in outputs:
            queue = self.streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)


def _resolve(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
