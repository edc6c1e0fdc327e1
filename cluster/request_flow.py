"""How one request travels through the cluster, as seen from the driver.

Disaggregated:
    router picks a prefill worker -> prefill(): queued, prefilled, first token
    sampled, KV exported -> ticket; the first token is streamed at once (default)
    -> router picks a decode worker -> generate(ticket): admission, KV import
    (event `imported`), decode stream; the prefill side is acked (blocks freed)
Colocated:
    router picks a colocated worker -> generate() prefills and decodes in one engine.

Recovery (the client only sees extra latency):
  * prefill worker dies before answering -> prefill again on another one; with no
    prefill worker alive, the decode worker prefills the prompt itself;
  * KV import fails -> `on_transfer_failure`: `recompute` on the decode worker, or
    fail with a clear error;
  * decode worker dies mid-stream -> another decode worker recomputes the KV of the
    prompt plus every token already decided and continues the same stream (sampling
    is seeded per output position, so even seeded sampling continues identically);
  * no live worker of a role for `recovery_timeout_s` -> NoLiveWorkerError (503).
Any worker call that fails marks that worker dead (router stops using it; the
controller restarts it). A caller that stops iterating aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.config import ClusterConfig
from cluster.router import NoLiveWorkerError, Router, WorkerInfo
from cluster.timeline import RequestTimeline
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WORKER_FAILURES = (RayActorError, ActorUnavailableError)
_PICK_RETRY_S = 0.1


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


@dataclass
class _Progress:
    """What the client has been promised so far; survives worker failures."""

    decided: list[int] = field(default_factory=list)
    """Token ids fixed for this request (sampled by some worker), in order."""
    pending_first: GenerationChunk | None = None
    """The prefill's first token when it is streamed only once decode starts."""
    text_len: int = 0
    """Characters of text of the decided tokens, as streamed (or about to be)."""
    ticket: dict | None = None
    prefill: WorkerInfo | None = None
    decode: WorkerInfo | None = None
    """Decode worker picked together with the prefill worker (the export's peer)."""
    acked: bool = False
    finished_at_prefill: bool = False


class RequestFlow:
    def __init__(
        self,
        config: ClusterConfig,
        router: Router,
        on_worker_failure: Callable[[WorkerInfo, str], None],
    ):
        self.config = config
        self.router = router
        self.on_worker_failure = on_worker_failure
        """The controller's `mark_dead`: called when a call to a worker fails."""

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timeline: RequestTimeline,
    ) -> AsyncIterator[GenerationChunk]:
        timeline.num_prompt_tokens = len(prompt_ids)
        progress = _Progress()
        try:
            if self.config.mode == "disaggregated":
                async for chunk in self._prefill_phase(
                    request_id, prompt_ids, params, timeline, progress
                ):
                    yield self._stamp(chunk, timeline, len(prompt_ids))
                if progress.finished_at_prefill:
                    return
            async for chunk in self._decode_phase(
                request_id, prompt_ids, params, timeline, progress
            ):
                yield self._stamp(chunk, timeline, len(prompt_ids))
        finally:
            self._drop_decode_pick(progress)  # picked with the prefill, never streamed from

    @staticmethod
    def _stamp(
        chunk: GenerationChunk, timeline: RequestTimeline, num_prompt: int
    ) -> GenerationChunk:
        now = time.time()
        timeline.stamp_token(now, len(chunk.token_ids))
        timeline.num_output_tokens = chunk.num_output_tokens
        chunk.num_prompt_tokens = num_prompt
        if chunk.finished:
            timeline.finish = now
            chunk.timings = timeline.breakdown()
        return chunk

    # --- prefill ----------------------------------------------------------------------

    async def _prefill_phase(self, request_id, prompt_ids, params, timeline, progress):
        result = await self._prefill_on_some_worker(
            request_id, prompt_ids, params, timeline, progress
        )
        if result is None:  # no prefill worker alive: the decode worker prefills
            timeline.recoveries.append("decode_side_prefill")
            return
        first = GenerationChunk(
            request_id,
            [result["first_token_id"]],
            result["first_text"],
            finished=result["finished"],
            finish_reason=result["finish_reason"],
            num_output_tokens=1,
        )
        progress.decided.append(result["first_token_id"])
        progress.text_len += len(first.text)
        progress.ticket = result["ticket"]
        progress.finished_at_prefill = first.finished
        if self.config.first_token_from == "prefill" or first.finished:
            yield first
        else:
            progress.pending_first = first

    async def _prefill_on_some_worker(self, request_id, prompt_ids, params, timeline, progress):
        """First prefill worker that answers; None when none is alive."""
        while True:
            try:
                prefill = self.router.pick("prefill", request_id)
            except NoLiveWorkerError:
                return None
            self._drop_decode_pick(progress)  # a retry picks both again
            progress.decode = self._pick_now("decode", request_id)
            if progress.decode is not None:
                _claim(progress.decode)
            peer_id = progress.decode.worker_id if progress.decode else ""
            try:
                result = await self._prefill(
                    prefill, request_id, prompt_ids, params, peer_id, timeline
                )
            except WORKER_FAILURES as exc:
                self._failed(prefill, exc, timeline, "prefill_died")
                continue
            progress.prefill = prefill
            timeline.prefill_worker = prefill.worker_id
            return result

    @staticmethod
    def _drop_decode_pick(progress: _Progress) -> None:
        if progress.decode is not None:
            _unclaim(progress.decode)
            progress.decode = None

    def _pick_now(self, role: str, request_id: str) -> WorkerInfo | None:
        try:
            return self.router.pick(role, request_id)
        except NoLiveWorkerError:
            return None

    async def _prefill(
        self, prefill: WorkerInfo, request_id, prompt_ids, params, peer_id, timeline
    ) -> dict:
        _claim(prefill)
        try:
            result = await prefill.handle.prefill.remote(request_id, prompt_ids, params, peer_id)
        finally:
            _unclaim(prefill)
        timeline.prefill_queue_start = result["queued_at"]
        timeline.prefill_queue_end = result["scheduled_at"]
        timeline.prefill_end = result["prefill_done_at"]
        return result

    # --- decode -----------------------------------------------------------------------

    async def _decode_phase(self, request_id, prompt_ids, params, timeline, progress):
        role = "colocated" if self.config.mode == "colocated" else "decode"
        try:
            while True:
                # The decode worker chosen with the prefill (the ticket names it) goes first,
                # with the claim taken at that pick; picking again would also advance
                # round_robin twice per request.
                worker = progress.decode if progress.decode and progress.decode.alive else None
                if worker is None:
                    self._drop_decode_pick(progress)
                    worker = await self._pick_waiting(role, request_id)
                    _claim(worker)
                progress.decode = None  # the stream below releases the claim
                timeline.decode_worker = worker.worker_id
                try:
                    async for chunk in self._decode_on(
                        worker, request_id, prompt_ids, params, timeline, progress
                    ):
                        yield chunk
                    return
                except WORKER_FAILURES as exc:
                    self._failed(worker, exc, timeline, f"{role}_died")
                    self._release_prefill_side(request_id, progress)
                    progress.ticket = None  # the next worker recomputes prompt + decided tokens
        except BaseException:
            self._release_prefill_side(request_id, progress)
            raise

    async def _decode_on(self, worker, request_id, prompt_ids, params, timeline, progress):
        stream = self._decode_stream(worker, request_id, prompt_ids, params, progress)
        async for item in stream:
            if item["event"] == "imported":
                self._on_imported(request_id, item, timeline, progress)
                continue
            if progress.pending_first is not None:
                first, progress.pending_first = progress.pending_first, None
                yield first
            progress.decided += item["token_ids"]
            progress.text_len += len(item["text"])
            yield _token_chunk(request_id, item)

    async def _pick_waiting(self, role: str, request_id: str) -> WorkerInfo:
        """A live worker of `role`, waiting up to `recovery_timeout_s` for one to come back."""
        deadline = time.monotonic() + self.config.recovery_timeout_s
        while True:
            try:
                return self.router.pick(role, request_id)
            except NoLiveWorkerError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(_PICK_RETRY_S)

    def _on_imported(
        self, request_id: str, item: dict, timeline: RequestTimeline, progress: _Progress
    ) -> None:
        timeline.decode_queue_start = item["admission_start"]
        timeline.decode_queue_end = item["transfer_start"]
        timeline.transfer_start = item["transfer_start"]
        timeline.transfer_end = item["transfer_end"]
        timeline.transport = item["transport"]
        timeline.kv_bytes = item["num_bytes"]
        timeline.transfer_ok = item["ok"]
        timeline.transfer_failure = item["reason"]
        if item["ok"]:
            progress.acked = True
            progress.prefill.handle.ack.remote(request_id)
            return
        self._release_prefill_side(request_id, progress)
        if self.config.on_transfer_failure == "fail":
            raise TransferFailedError(request_id, item["reason"], item["message"])
        timeline.recomputed = True
        timeline.recoveries.append("transfer_failed")

    def _release_prefill_side(self, request_id: str, progress: _Progress) -> None:
        """Return the exported blocks now rather than at lease expiry."""
        if progress.prefill is not None and progress.ticket is not None and not progress.acked:
            progress.acked = True
            if progress.prefill.alive:
                progress.prefill.handle.abort.remote(request_id)

    def _failed(
        self, worker: WorkerInfo, exc: BaseException, timeline: RequestTimeline, what: str
    ) -> None:
        logger.warning("request %s: %s (%s): %r", timeline.request_id, what, worker.worker_id, exc)
        timeline.recoveries.append(what)
        self.on_worker_failure(worker, repr(exc))

    async def _decode_stream(
        self, worker: WorkerInfo, request_id, prompt_ids, params, progress: _Progress
    ):
        """One decode worker's stream, resuming from what `progress` has decided so far.
        The caller has claimed `worker`; the stream releases the claim when it ends."""
        finished = False
        try:
            stream = worker.handle.generate.options(num_returns="streaming").remote(
                request_id,
                prompt_ids,
                list(progress.decided),
                params,
                progress.ticket,
                progress.text_len,
            )
            async for ref in stream:
                item = await ref
                finished = item.get("finished", False)
                yield item
        finally:
            _unclaim(worker)
            if not finished and worker.alive:
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


def _claim(worker: WorkerInfo) -> None:
    """Count a request against `worker` from the moment it is picked, so that a burst of
    requests routed before any health report arrives spreads over the pool."""
    worker.in_flight += 1


def _unclaim(worker: WorkerInfo) -> None:
    # Never below zero: a restart resets the count while old requests still unwind.
    worker.in_flight = max(0, worker.in_flight - 1)
