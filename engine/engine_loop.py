"""Drives an `LLMEngine` on a dedicated thread for async (Ray actor) callers.

The engine is synchronous and CPU-bound; running it on the actor's event loop would
stall health checks and streaming. So one thread owns the engine: it runs queued
commands between steps (add, abort, export...), steps while there is work, and hands
each step's outputs back to the event loop, where per-request queues feed streams.

A request's stream here: the worker opens it (`open_stream`) before adding the
request, reads `SequenceOutput`s (and whatever else the worker `deliver`s, such as
an import's outcome) until a finished one or `None`, which means the request was
aborted, and closes it. Every abort goes through `abort`, which wakes the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine
from engine.sequence import SequenceOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
PREFAULT_STEP_BYTES = 2 << 20
"""KV pool pages the warming thread maps per call (`KVCachePool.prefault`)."""


class EngineLoop:
    """One per worker process, created on first use inside the actor's event loop (an
    actor's constructor runs outside it); stopped at shutdown.

    `on_iteration(engine)` runs on the engine thread once per iteration (the workers
    free blocks released by transports and start imports there); `on_abort(engine,
    request_id)` runs on the engine thread right after every engine abort (the workers
    release the request's export or cancel its transfer); `on_outputs(engine, outputs)`
    runs on the engine thread right after each step, before the next one, and returns
    what to deliver instead (the prefill worker exports prefilled sequences there, so
    their first tokens never wait for another step); `on_step(engine)` runs on the
    engine thread right after every step, before `on_outputs`, outputs or not (the
    prefill worker exports the blocks each prefill chunk completed there)."""

    def __init__(
        self,
        engine: LLMEngine,
        on_iteration: Callable[[LLMEngine], None] | None = None,
        on_abort: Callable[[LLMEngine, str], None] | None = None,
        on_outputs: Callable[[LLMEngine, list[SequenceOutput]], list] | None = None,
        track_stepping: bool = False,
        on_step: Callable[[LLMEngine], None] | None = None,
    ):
        self.engine = engine
        self.track_stepping = track_stepping
        self.on_iteration = on_iteration
        self.on_abort = on_abort
        self.on_outputs = on_outputs
        self.on_step = on_step
        self.loop = asyncio.get_event_loop()
        self.commands: deque[tuple[Callable, asyncio.Future | None]] = deque()
        self.streams: dict[str, asyncio.Queue] = {}
        self.wakeup = threading.Event()
        self.running = True
        self.stepping: dict[str, str] | None = None
        """With `track_stepping`, while a step runs: its engine's requests as they were
        when it began (`LLMEngine.request_states`), for readers that must not wait for the
        step to end (a prefill worker's debug state: one prefill step can take seconds);
        else None. Off by default: it costs a snapshot per step that only they read."""
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()
        threading.Thread(target=self._warm_pool, name="kv-pool-warmer", daemon=True).start()

    # --- called on the event loop -------------------------------------------------------

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
        """The one abort path of both worker kinds: end the request's stream (its reader
        gets `None`), then abort it on the engine thread and run `on_abort`."""
        queue = self.streams.get(request_id)
        if queue is not None:
            queue.put_nowait(None)
        return self.call(lambda e: self._abort(e, request_id))

    def stop(self) -> None:
        self.running = False
        self.wakeup.set()
        self.thread.join(timeout=5)

    # --- called from any thread ---------------------------------------------------------

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Queue `fn(engine)` for the engine thread without waiting for it (e.g. from a
        transfer thread when its bytes have landed)."""
        self.commands.append((fn, None))
        self.wakeup.set()

    def deliver(self, request_id: str, item: Any) -> None:
        """Hand `item` to the request's stream; from the engine thread, in step order."""
        self.loop.call_soon_threadsafe(self._put, request_id, item)

    # --- the engine thread --------------------------------------------------------------

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        aborted = engine.abort(request_id)
        if self.on_abort is not None:
            self.on_abort(engine, request_id)
        return aborted

    def _run(self) -> None:
        while self.running:
            self._run_commands()
            if self.on_iteration:
                self.on_iteration(self.engine)
            if not self.engine.has_unfinished():
                self.wakeup.wait(_IDLE_WAIT_S)
                self.wakeup.clear()
                continue
            if self.track_stepping:
                self.stepping = self.engine.request_states()
            try:
                outputs = self.engine.step()
            except Exception:
                logger.exception("engine step failed")
                raise
            finally:
                self.stepping = None
            if self.on_step is not None:
                self.on_step(self.engine)
            if outputs and self.on_outputs is not None:
                outputs = self.on_outputs(self.engine, outputs)
            if outputs:
                self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _warm_pool(self) -> None:
        """Map the KV pool's pages ahead of the steps that will write them, on cores
        nobody else wants: this thread runs at SCHED_IDLE, so it takes no CPU from the
        engine, another worker or a restart. A fresh pool's first-touch faults otherwise
        fall in steps (~15 ms of a ~120 ms 256-token bf16 prefill), for every request
        until the pool has been written once."""
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while self.running and self.engine.kv_pool.prefault(PREFAULT_STEP_BYTES):
            pass

    def _run_commands(self) -> None:
        while self.commands:
            fn, future = self.commands.popleft()
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # handed to the awaiting caller, not lost
                result, error = None, exc
                if future is None:
                    logger.exception("engine command failed")
            if future is not None:
                self.loop.call_soon_threadsafe(_resolve, future, result, error)

    def _deliver(self, outputs: list) -> None:
        """Each item goes to the stream named by its `request_id`."""
        for output in outputs:
            self._put(output.request_id, output)

    def _put(self, request_id: str, item: Any) -> None:
        queue = self.streams.get(request_id)
        if queue is not None:
            queue.put_nowait(item)


def _resolve(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
