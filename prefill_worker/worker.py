"""The prefill worker: a Ray actor that runs prompts and exports their KV.

Lifecycle of a request here:
    prefill() called by the cluster's request flow
    -> queued in the engine (batched with other prompts up to the token budget,
       chunked when longer than the prefill chunk)
    -> first token sampled; the sequence leaves the engine with its blocks
    -> blocks exported through the KV sender under a lease; the ticket goes back
       to the caller, which hands it to a decode worker
    -> ack (decode imported them), abort, or lease expiry returns the blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from cluster.config import ClusterConfig
from cluster.worker_report import health_report, node_ip
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    """What `prefill` returns: the first token and, unless finished, the export ticket."""

    request_id: str
    worker_id: str
    first_token_id: int
    first_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    ticket: dict | None
    queued_at: float
    scheduled_at: float | None
    prefill_done_at: float
    exported_at: float | None


class PrefillWorker:
    """Instantiated as a named Ray actor by the controller (one per prefill slot)."""

    def __init__(self, worker_id: str, config: ClusterConfig):
        self.worker_id = worker_id
        self.config = config
        self.engine = LLMEngine(config.engine_config("prefill"))
        from kv_transfer.registry import make_sender

        self.sender = make_sender(
            config.transport,
            worker_id,
            self.engine.kv_pool,
            config.kv_transport_options(node_ip=node_ip()),
        )
        self.loop: EngineLoop | None = None

    def _engine_loop(self) -> EngineLoop:
        # Created lazily inside the actor's event loop (the constructor runs outside it).
        if self.loop is None:
            self.loop = EngineLoop(self.engine, on_iteration=self._free_released)
        return self.loop

    def _free_released(self, engine: LLMEngine) -> None:
        for block_ids in self.sender.poll_released():
            engine.release_blocks(block_ids)

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, peer_id: str
    ) -> dict:
        """Called once per request by the request flow; returns `PrefillResult` as a dict."""
        loop = self._engine_loop()
        queued_at = time.time()
        stream = loop.open_stream(request_id)
        try:
            seq = await loop.call(
                lambda e: e.add_request(
                    request_id, prompt_token_ids, params, stop_after_prefill=True
                )
            )
            output = await stream.get()
        finally:
            loop.close_stream(request_id)
        result = PrefillResult(
            request_id=request_id,
            worker_id=self.worker_id,
            first_token_id=output.new_token_ids[0],
            first_text=output.new_text,
            finished=output.finished,
            finish_reason=output.finish_reason,
            num_prompt_tokens=output.num_prompt_tokens,
            ticket=None,
            queued_at=queued_at,
            scheduled_at=seq.first_scheduled_at,
            prefill_done_at=time.time(),
            exported_at=None,
        )
        if not output.finished:
            ticket = await loop.call(lambda e: self._export(e, request_id, peer_id))
            result.ticket = ticket.to_dict()
            result.exported_at = time.time()
        return asdict(result)

    def _export(self, engine: LLMEngine, request_id: str, peer_id: str):
        seq = engine.take_prefilled(request_id)
        return self.sender.export(request_id, seq.block_ids, seq.num_prompt_tokens, peer_id)

    async def ack(self, request_id: str) -> None:
        """Called after the decode worker imported the KV: the blocks can go back."""
        self.sender.ack(request_id)

    async def abort(self, request_id: str) -> None:
        """Called when the client went away or the decode side failed."""
        await self._engine_loop().call(lambda e: e.abort(request_id))
        self.sender.abort(request_id)

    async def check_health(self) -> dict:
        """Called by the controller's watchdog; raises (or times out) when unhealthy."""
        health = health_report(
            self.worker_id, "prefill", self.engine, self._engine_loop(), self.config.device
        )
        health["transfer"] = asdict(self.sender.stats())
        return health

    async def debug_state(self) -> dict:
        """Leak checks in tests and drills: blocks in use and leases outstanding."""
        return {
            "used_blocks": self.engine.allocator.num_used,
            "outstanding_leases": self.sender.stats().pinned_requests,
            "sequences": len(self.engine.sequences),
        }

    async def endpoint(self) -> dict:
        return self.sender.endpoint()

    async def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        self.sender.close()
