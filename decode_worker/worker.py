"""The decode worker: a Ray actor that imports KV and streams tokens.

Lifecycle of a request here (`generate`, a streaming call):
    admission: wait until the pool has blocks for the prompt's KV (never dropped)
    -> import: the KV receiver pulls the prompt's blocks from the prefill worker
       into the reserved blocks (or, with no ticket, the prompt is prefilled here:
       colocated mode, recovery, or `on_transfer_failure: recompute`)
    -> the sequence joins the continuous decode batch; each step's token is
       yielded to the caller as it is made
    -> finish (stop/length) or abort (caller went away): blocks back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from cluster.config import ClusterConfig
from cluster.worker_report import health_report, node_ip
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer.base import ExportTicket, TransferResult

logger = logging.getLogger(__name__)

_ADMISSION_POLL_S = 0.005
_KEEPALIVE_EVERY_S = 1.0


@dataclass(frozen=True)
class _DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens already decided (by prefill or an earlier decode worker)."""
    params: SamplingParams
    emitted_text_len: int
    """Characters of their text the client already has."""


class DecodeWorker:
    """Instantiated as a named Ray actor by the controller; also the colocated worker."""

    def __init__(self, worker_id: str, config: ClusterConfig, role: str = "decode"):
        self.worker_id = worker_id
        self.role = role
        self.config = config
        self.engine = LLMEngine(config.engine_config("decode"))
        self.receiver = None
        if role == "decode":
            from kv_transfer.registry import make_receiver

            self.receiver = make_receiver(
                config.transport,
                worker_id,
                self.engine.kv_pool,
                config.kv_transport_options(node_ip=node_ip()),
            )
        self.loop: EngineLoop | None = None
        self.admission_waiting = 0

    def _engine_loop(self) -> EngineLoop:
        if self.loop is None:
            self.loop = EngineLoop(self.engine)
        return self.loop

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        ticket: dict | None = None,
        emitted_text_len: int = 0,
    ) -> AsyncIterator[dict]:
        """Streaming call, one per request. Yields an `imported` event (when a ticket was
        given), then one item per new token; the last item has `finished`.
        `emitted_text_len`: characters of the output the client already has."""
        loop = self._engine_loop()
        stream = loop.open_stream(request_id)
        request = _DecodeRequest(
            request_id, prompt_token_ids, output_token_ids, params, emitted_text_len
        )
        finished = False
        try:
            if ticket is not None:
                event = await self._import(request, ticket)
                yield event
                if not event["ok"]:
                    if self.config.on_transfer_failure == "fail":
                        return
                    await self._prefill_here(request)
            else:
                await self._prefill_here(request)
            while not finished:
                output = await stream.get()
                if output is None:  # aborted by the caller
                    return
                finished = output.finished
                yield {
                    "event": "token",
                    "token_ids": output.new_token_ids,
                    "text": output.new_text,
                    "finished": output.finished,
                    "finish_reason": output.finish_reason,
                    "num_output_tokens": output.num_output_tokens,
                    "time": time.time(),
                }
        finally:
            loop.close_stream(request_id)
            if not finished:
                await loop.call(lambda e: e.abort(request_id))

    async def _prefill_here(self, r: _DecodeRequest) -> None:
        """Compute the KV of prompt + decided tokens here (colocated, recovery, recompute)."""
        await self._engine_loop().call(
            lambda e: e.add_request(
                r.request_id,
                r.prompt_token_ids,
                r.params,
                output_token_ids=r.output_token_ids,
                emitted_text_len=r.emitted_text_len,
            )
        )

    async def _import(self, r: _DecodeRequest, ticket_dict: dict) -> dict:
        loop = self._engine_loop()
        ticket = ExportTicket.from_dict(ticket_dict)
        admission_start = time.time()
        block_ids = await self._admit(r.request_id, ticket)
        transfer_start = time.time()
        result: TransferResult = await asyncio.to_thread(
            self.receiver.fetch, ticket, block_ids, self.config.transfer_timeout_s
        )
        transfer_end = time.time()
        if result.ok:
            await loop.call(
                lambda e: e.add_prefilled(
                    r.request_id,
                    r.prompt_token_ids,
                    r.output_token_ids,
                    r.params,
                    block_ids,
                    emitted_text_len=r.emitted_text_len,
                )
            )
        else:
            await loop.call(lambda e: e.release_blocks(block_ids))
            logger.warning(
                "request %s: KV import failed: %s %s", r.request_id, result.reason, result.message
            )
        return {
            "event": "imported",
            "ok": result.ok,
            "transport": result.transport,
            "num_bytes": result.num_bytes,
            "reason": result.reason.value if result.reason else None,
            "message": result.message,
            "admission_start": admission_start,
            "transfer_start": transfer_start,
            "transfer_end": transfer_end,
            "worker_id": self.worker_id,
        }

    async def _admit(self, request_id: str, ticket: ExportTicket) -> list[int]:
        """Reserve blocks for the imported KV, waiting (never failing) while the pool is full.
        While it waits, the sender's lease on the exported blocks is kept alive."""
        loop = self._engine_loop()
        self.admission_waiting += 1
        last_keepalive = time.monotonic()
        try:
            while True:
                block_ids = await loop.call(
                    lambda e: e.reserve_blocks(ticket.num_tokens, request_id)
                )
                if block_ids is not None:
                    return block_ids
                if time.monotonic() - last_keepalive > _KEEPALIVE_EVERY_S:
                    last_keepalive = time.monotonic()
                    await asyncio.to_thread(self.receiver.keepalive, ticket)
                await asyncio.sleep(_ADMISSION_POLL_S)
        finally:
            self.admission_waiting -= 1

    async def abort(self, request_id: str) -> None:
        """Called when the client went away: stop decoding, free the blocks."""
        await self._engine_loop().abort(request_id)

    async def check_health(self) -> dict:
        """Called by the controller's watchdog; raises (or times out) when unhealthy."""
        health = health_report(
            self.worker_id,
            self.role,
            self.engine,
            self._engine_loop(),
            self.config.device,
            self.admission_waiting,
        )
        if self.receiver is not None:
            health["transfer"] = asdict(self.receiver.stats())
        return health

    async def debug_state(self) -> dict:
        return {
            "used_blocks": self.engine.allocator.num_used,
            "sequences": len(self.engine.sequences),
        }

    async def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self.receiver is not None:
            self.receiver.close()
