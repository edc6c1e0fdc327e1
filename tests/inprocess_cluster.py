"""A disaggregated cluster in one process, without Ray: a real prefill worker and a real
decode worker (engines, KV senders and receivers of the transport named, the engine
loops on their threads) as plain objects, behind handles that answer `.remote(...)` as
Ray's do, driven by the real `RequestFlow`. For the paths between the workers (export,
import, streaming, relays) on every transport, at a fraction of a Ray cluster's start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from cluster.config import ClusterConfig
from cluster.control.worker_info import WorkerInfo
from cluster.flow.request import CloseReason, ClusterRequest, GenerationChunk
from cluster.flow.request_flow import RequestFlow
from cluster.flow.router import Router
from cluster.timeline import RequestTimeline
from decode_worker.worker import DecodeWorker
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.cluster_helpers import wait_until_leak_free


class LocalMethod:
    """`handle.method.remote(*args)` / `.options(...)`: the call runs on this event loop;
    a coroutine comes back as a future, an async generator as a stream of futures."""

    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        result = self.fn(*args)
        if hasattr(result, "__aiter__"):
            return LocalStream(result)
        if asyncio.iscoroutine(result):
            return asyncio.ensure_future(result)
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class LocalStream:
    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.agen.__anext__()
        future = asyncio.get_running_loop().create_future()
        future.set_result(item)
        return future


class ActorHandle:
    """Stands in for a Ray actor handle of a worker object in this process."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name: str) -> LocalMethod:
        return LocalMethod(getattr(self.actor, name))


class InProcessCluster:
    """One prefill and one decode worker of `config`; build it inside a running loop."""

    def __init__(self, config: ClusterConfig):
        if not config.transport.token:
            config = config.replace(transport={"token": "in-process-token"})
        self.config = config
        self.prefill = PrefillWorker(config.worker_spec("prefill-0", "prefill"))
        self.decode = DecodeWorker(config.worker_spec("decode-0", "decode"))
        self.workers = {
            "prefill-0": WorkerInfo("prefill-0", "prefill", ActorHandle(self.prefill)),
            "decode-0": WorkerInfo("decode-0", "decode", ActorHandle(self.decode)),
        }
        self.flow = RequestFlow(config, Router("round_robin", self.workers), self._mark_dead)
        self._ids = 0

    def _mark_dead(self, worker: WorkerInfo, why: str, generation: int) -> None:
        worker.alive = False

    def open_request(self, prompt: list[int], params: SamplingParams) -> ClusterRequest:
        self._ids += 1
        request_id = f"inproc-{self._ids}"
        return ClusterRequest(
            request_id, list(prompt), params, RequestTimeline(request_id, time.monotonic())
        )

    async def run(self, req: ClusterRequest) -> AsyncIterator[GenerationChunk]:
        """As `PDCluster.run`: the flow's chunks, the request closed however it ends."""
        reason = CloseReason.ERROR
        stream = self.flow.run(req)
        try:
            async for chunk in stream:
                req.timeline.stamp_token(time.monotonic(), len(chunk.token_ids))
                if chunk.finished:
                    req.timeline.finish = time.monotonic()
                yield chunk
            reason = CloseReason.FINISHED
        except (GeneratorExit, asyncio.CancelledError):
            reason = CloseReason.CANCELLED
            raise
        finally:
            await stream.aclose()
            req.close(reason)

    async def generate(self, prompt: list[int], params: SamplingParams):
        """(tokens, the closed request)."""
        req = self.open_request(prompt, params)
        tokens: list[int] = []
        async for chunk in self.run(req):
            tokens += chunk.token_ids
        return tokens, req

    def chunks_view(self) -> ChunksView:
        """This cluster with PDCluster's `generate` (for tests/cluster_helpers.collect)."""
        return ChunksView(self)

    async def debug_states(self) -> dict[str, dict]:
        return {
            "prefill-0": await self.prefill.debug_state(),
            "decode-0": await self.decode.debug_state(),
        }

    async def assert_leak_free(self, wait_s: float = 5.0) -> None:
        """No KV block, lease, sequence or streamed import left on either worker."""
        await wait_until_leak_free(self.debug_states, wait_s)

    async def shutdown(self) -> None:
        self.flow.streams.close()
        for worker in (self.prefill, self.decode):
            await worker.shutdown()


class ChunksView:
    """`generate(prompt, params)` as PDCluster has it: the chunks as they come, the last
    one carrying the request's timings."""

    def __init__(self, cluster: InProcessCluster):
        self.cluster = cluster

    async def generate(self, prompt: list[int], params: SamplingParams):
        req = self.cluster.open_request(prompt, params)
        chunk = None
        async for chunk in self.cluster.run(req):
            yield chunk
        if chunk is not None:
            chunk.timings = req.timeline.breakdown()
