"""How one request travels through the cluster, as seen from the driver.

Disaggregated:
    router picks (prefill, decode)
    -> prefill.prefill(): queued, prefilled, first token sampled, KV exported -> ticket
    -> first token streamed to the caller at once (default) while the KV moves
    -> decode.generate(ticket): admission, KV import (event `imported`), decode stream
    -> on import the prefill side is acked (its blocks go back); on failure aborted
Colocated:
    router picks a colocated worker -> generate() prefills and decodes in one engine.

A caller that stops iterating (client disconnect) aborts the request on its workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cluster.config import ClusterConfig
from cluster.router import Router, WorkerInfo
from cluster.timeline import RequestTimeline
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class TransferFailedError(RuntimeError):
    """KV transfer failed and the policy is `fail`."""

    def __init__(self, request_id: str, reason: str | None, message: str):
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"[request {request_id}] KV transfer failed ({reason}): {message}")


@dataclass
class GenerationChunk:
    """One streamed piece of a generation, as the Python API and the frontend see it."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: dict = field(default_factory=dict)
    """Set on the final chunk: the per-phase breakdown (`RequestTimeline.breakdown`)."""


class RequestFlow:
    def __init__(self, config: ClusterConfig, router: Router):
        self.config = config
        self.router = router

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timeline: RequestTimeline,
    ) -> AsyncIterator[GenerationChunk]:
        timeline.num_prompt_tokens = len(prompt_ids)
        if self.config.mode == "colocated":
            source = self._colocated(request_id, prompt_ids, params, timeline)
        else:
            source = self._disaggregated(request_id, prompt_ids, params, timeline)
        async for chunk in source:
            now = time.time()
            timeline.stamp_token(now, len(chunk.token_ids))
            timeline.num_output_tokens = chunk.num_output_tokens
            chunk.num_prompt_tokens = len(prompt_ids)
            if chunk.finished:
                timeline.finish = now
                chunk.timings = timeline.breakdown()
            yield chunk

    async def _colocated(
        self, request_id, prompt_ids, params, timeline
    ) -> AsyncIterator[GenerationChunk]:
        worker = self.router.pick("colocated", request_id)
        timeline.decode_worker = worker.worker_id
        async for item in self._decode_stream(worker, request_id, prompt_ids, [], params, None):
            yield _token_chunk(request_id, item)

    async def _disaggregated(
        self, request_id, prompt_ids, params, timeline
    ) -> AsyncIterator[GenerationChunk]:
        prefill = self.router.pick("prefill", request_id)
        decode = self.router.pick("decode", request_id)
        timeline.prefill_worker, timeline.decode_worker = prefill.worker_id, decode.worker_id
        result = await self._prefill(
            prefill, request_id, prompt_ids, params, decode.worker_id, timeline
        )
        first = GenerationChunk(
            request_id,
            [result["first_token_id"]],
            result["first_text"],
            finished=result["finished"],
            finish_reason=result["finish_reason"],
            num_output_tokens=1,
        )
        first_pending = True
        if self.config.first_token_from == "prefill" or first.finished:
            first_pending = False
            yield first
        if first.finished:
            return
        stream = self._decode_stream(
            decode, request_id, prompt_ids, [first.token_ids[0]], params, result["ticket"]
        )
        try:
            async for item in stream:
                if item["event"] == "imported":
                    self._on_imported(prefill, request_id, item, timeline)
                    continue
                if first_pending:
                    first_pending = False
                    yield first
                yield _token_chunk(request_id, item)
        except BaseException:
            prefill.handle.abort.remote(request_id)
            raise

    async def _prefill(
        self, prefill: WorkerInfo, request_id, prompt_ids, params, peer_id, timeline
    ) -> dict:
        prefill.in_flight += 1
        try:
            result = await prefill.handle.prefill.remote(request_id, prompt_ids, params, peer_id)
        finally:
            prefill.in_flight -= 1
        timeline.prefill_queue_start = result["queued_at"]
        timeline.prefill_queue_end = result["scheduled_at"]
        timeline.prefill_end = result["prefill_done_at"]
        return result

    def _on_imported(
        self, prefill: WorkerInfo, request_id: str, item: dict, timeline: RequestTimeline
    ) -> None:
        timeline.decode_queue_start = item["admission_start"]
        timeline.decode_queue_end = item["transfer_start"]
        timeline.transfer_start = item["transfer_start"]
        timeline.transfer_end = item["transfer_end"]
        timeline.transport = item["transport"]
        timeline.kv_bytes = item["num_bytes"]
        timeline.transfer_ok = item["ok"]
        if item["ok"]:
            prefill.handle.ack.remote(request_id)
            return
        prefill.handle.abort.remote(request_id)
        if self.config.on_transfer_failure == "fail":
            raise TransferFailedError(request_id, item["reason"], item["message"])
        timeline.recomputed = True

    async def _decode_stream(
        self, worker: WorkerInfo, request_id, prompt_ids, output_ids, params, ticket
    ):
        worker.in_flight += 1
        finished = False
        try:
            stream = worker.handle.generate.options(num_returns="streaming").remote(
                request_id, prompt_ids, output_ids, params, ticket
            )
            async for ref in stream:
                item = await ref
                finished = item.get("finished", False)
                yield item
        finally:
            worker.in_flight -= 1
            if not finished:
                worker.handle.abort.remote(request_id)


def _token_chunk(request_id: str, item: dict) -> GenerationChunk:
    return GenerationChunk(
        request_id=request_id,
        token_ids=item["token_ids"],
        text=item["text"],
        finished=item["finished"],
        finish_reason=item["finish_reason"],
        num_output_tokens=item["num_output_tokens"],
    )
