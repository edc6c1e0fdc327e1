"""The Python API: start a cluster, stream generations, shut it down.

cluster = PDCluster(ClusterConfig(model="demo"))
await cluster.start()
async for chunk in cluster.generate("Hello", SamplingParams(max_tokens=16)):
    print(chunk.text, end="")
await cluster.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from cluster.config import ClusterConfig
from cluster.controller import Controller
from cluster.request_flow import GenerationChunk, RequestFlow
from cluster.router import Router
from cluster.timeline import RequestTimeline
from engine import envs
from engine.demo_model import resolve_model
from engine.model_spec import load_model_spec
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class RequestTimeoutError(TimeoutError):
    """A request ran past `request_timeout_s`; it was aborted on its workers."""

    def __init__(self, request_id: str, timeout_s: float):
        self.request_id = request_id
        super().__init__(f"[request {request_id}] exceeded request_timeout_s={timeout_s}")


class PDCluster:
    """Owned by one driver process (the HTTP frontend, a test, a script)."""

    def __init__(self, config: ClusterConfig):
        if not config.cluster_token:
            config = config.replace(cluster_token=envs.cluster_token() or secrets.token_hex(16))
        self.config = config
        model_dir, self.model_id = resolve_model(config.model)
        self.tokenizer = Tokenizer(model_dir)
        context = load_model_spec(model_dir, self.model_id).context_window
        self.max_model_len = min(config.max_model_len or context, context)
        self.controller = Controller(config)
        self.router = Router(config.router_policy, self.controller.workers)
        self.flow = RequestFlow(config, self.router, self.controller.mark_dead)
        self.on_finish: list[Callable[[RequestTimeline, GenerationChunk], None]] = []
        """Observers (metrics), called once per request however it ends (done, failed,
        cancelled) with its timeline and last chunk (None when no token came)."""
        self._ids = itertools.count()

    async def start(self) -> PDCluster:
        await self.controller.start()
        return self

    async def shutdown(self) -> None:
        await self.controller.shutdown()

    async def __aenter__(self) -> PDCluster:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream a generation; text prompts are tokenized here (no chat template).
        Raises `RequestTimeoutError` past `request_timeout_s` (the request is aborted)."""
        request_id = request_id or self.new_request_id()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        timeline = RequestTimeline(request_id, arrival=time.time())
        deadline = time.monotonic() + self.config.request_timeout_s
        stream = self.flow.run(request_id, prompt_ids, params, timeline)
        last: GenerationChunk | None = None
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(stream), deadline - time.monotonic())
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise RequestTimeoutError(request_id, self.config.request_timeout_s) from None
                last = chunk
                yield chunk
        finally:
            await stream.aclose()
            # Cancelled and failed requests too: their tokens and KV transfers happened.
            for observer in self.on_finish:
                observer(timeline, last)
