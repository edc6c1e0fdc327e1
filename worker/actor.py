"""What the prefill and the decode actor share: how a worker is built (at once, or later
on a prestarted process), the engine loop it runs its engine on, and the calls the
cluster makes on any worker (abort, step traces, the death watch, the start of
shutdown). Each worker adds its role's calls and its transport.
"""

from __future__ import annotations

import asyncio

from engine.cpu_affinity import pin_process
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from worker.health import StartupTimer, step_trace
from worker.spec import WorkerSpec
from worker.tp_ranks import TPRanks

RANK_HEALTH_TIMEOUT_S = 3.0
"""A follower rank slower than this to answer rank 0's health check fails it (below
the controller's own default timeout, so the failure names the rank)."""


class EngineActor:
    """Base of `PrefillWorker` and `DecodeWorker` (both Ray actors). A subclass builds its
    engine and transport in `_build` and may override `_make_loop` to hook the loop."""

    spec: WorkerSpec | None = None
    engine: LLMEngine
    loop: EngineLoop | None = None
    stopped: asyncio.Event | None = None
    ranks: TPRanks | None = None
    """The other ranks of a tensor-parallel worker (None: one rank)."""

    def __init__(self, spec: WorkerSpec | None = None, transport: str | None = None):
        """`spec` None makes a prestarted process (cluster/control/prestarted.py): Ray's worker,
        Python and every import, `transport`'s module included, are up, but nothing is
        built until `activate`."""
        if spec is not None:
            self._start(spec, StartupTimer())
        elif transport is not None:
            from kv_transfer.registry import preload

            preload(transport)

    def _start(self, spec: WorkerSpec, timer: StartupTimer) -> None:
        # Pinned before the build: the OpenMP threads the engine starts inherit the cores.
        if spec.cpu_cores is not None:
            pin_process(spec.cpu_cores)
        self._build(spec, timer)

    def _build(self, spec: WorkerSpec, timer: StartupTimer) -> None:
        """Build the engine and the transport for `spec`, lapping `timer` after each."""
        raise NotImplementedError

    def _make_engine(self, spec: WorkerSpec) -> LLMEngine:
        """This worker's engine; on a tensor-parallel worker rank 0's, once its followers
        (started here, each building its own shard meanwhile) have joined its group."""
        if spec.tp_size == 1:
            return LLMEngine(spec.engine)
        self.ranks = TPRanks.start(spec)
        return LLMEngine(spec.engine, self.ranks.group)

    async def _rank_pids(self) -> tuple[int, ...]:
        """Called by `check_health`: the follower ranks' processes, after each answered
        its own health check (raises when one did not: the worker is unhealthy)."""
        if self.ranks is None:
            return ()
        self.ranks.watch()
        await self.ranks.check(RANK_HEALTH_TIMEOUT_S)
        return self.ranks.pids

    async def activate(self, spec: WorkerSpec) -> dict[str, float]:
        """Called once by the controller on a prestarted process, when a restart takes it
        to be `spec.worker_id`'s next generation; returns its startup durations. The
        build runs on the event loop: nothing else reaches a process before this."""
        if self.spec is not None:
            raise RuntimeError(f"already activated as {self.spec.worker_id}")
        self._start(spec, StartupTimer(prestarted=True))
        return self.startup

    def _make_loop(self) -> EngineLoop:
        return EngineLoop(self.engine)

    def _engine_loop(self) -> EngineLoop:
        # Created lazily inside the actor's event loop (the constructor runs outside it).
        if self.loop is None:
            self.loop = self._make_loop()
        return self.loop

    async def abort(self, request_id: str) -> None:
        """Called when the request's owner closes it (client gone, error, a failed
        phase): whatever this worker holds for it, queued, running, being imported or
        exported, is released (an import's blocks once its transfer stops writing)."""
        await self._engine_loop().abort(request_id)

    async def steps(self, last: int = 512) -> list[dict]:
        """The engine's last `last` steps (`/admin/steps`, the scheduling write-ups)."""
        return await self._engine_loop().call(lambda e: step_trace(e, last))

    async def wait_until_stopped(self) -> None:
        """The controller's death watch: returns only at shutdown, so a failure of this
        call means the actor died (Ray reports that within milliseconds)."""
        self.stopped = self.stopped or asyncio.Event()
        await self.stopped.wait()

    def _stop_engine(self) -> None:
        """First half of `shutdown`: release the death watch, stop the engine thread (and
        then a tensor-parallel worker's followers)."""
        if self.stopped is not None:
            self.stopped.set()
        if self.loop is not None:
            self.loop.stop()
        if self.ranks is not None:
            stopped = self.loop is None or not self.loop.thread.is_alive()
            self.ranks.stop(getattr(self, "engine", None), stopped)
