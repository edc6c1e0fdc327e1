"""How one request travels through the cluster, as seen from the driver.

Disaggregated:
    router picks a prefill worker and a decode worker (claims) -> prefill(): queued,
    prefilled, first token sampled, KV exported -> PrefillResult with the ticket; the
    first token is streamed at once (default) -> generate(ticket) on the decode
    worker: ImportEvent (admission + KV import), then the decode stream; the prefill
    side is acked (blocks freed)
Colocated:
    router picks a colocated worker -> generate() prefills and decodes in one engine.
Streamed (`kv_streaming: chunk`): the decode request goes out with the prefill, before
    any KV exists, so the decode worker reserves its blocks at once; each prefill
    chunk's completed blocks are exported as a segment as soon as its step ends, and
    reach the decode worker while the next chunk computes: relayed here one ticket at a
    time (`kv_transfer_mode: pull`, the decode worker pulls each at once), or sent by
    the prefill worker's sender down the one transfer the decode worker opened (`push`).
    The prefill's reply (first token, final segment) is relayed too; the import ends
    once every block and the first token are there. A prefill worker that dies
    mid-stream leaves the decode worker what landed: it computes only the rest.
Where the prompt is prefilled (`disaggregation`, cluster/flow/disaggregation.py): `always`
on the prefill worker, `never` on the decode worker (no prefill pick, no transfer),
`auto` per request from measured costs, after the pair is picked. Picks pass the
prompt to the router, so `cache_aware` can send it where its prefix is cached.

Recovery (the client only sees extra latency):
  * prefill worker dies before answering -> prefill again on another one; with no
    prefill worker alive, the decode worker prefills the prompt itself;
  * KV import fails -> `on_transfer_failure`: `recompute` on the decode worker, or
    fail with a clear error;
  * decode worker dies mid-stream -> another decode worker continues the same stream
    (sampling is seeded per output position, so even seeded sampling continues
    identically). It gets the prompt's KV by re-pulling the export while that is still
    pinned, from the prefill worker whose prefix cache still holds it (`reprefill`), or
    by recomputing it, whichever the measured costs say is sooner, then computes the
    tokens already decided;
  * no live worker of a role for `recovery_timeout_s` -> NoLiveWorkerError (503).
Any worker call that fails marks that worker dead (router stops using it; the
controller restarts it). Worker-side errors come back as `ErrorEvent`s and are raised
here as `RequestFailedError` with their kind. Everything the flow leaves on a worker
is recorded on the `ClusterRequest`, whose `close` releases it however the request
ends; the flow itself never aborts or releases on its way out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable

from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.config import ClusterConfig
from cluster.control.worker_info import WorkerInfo
from cluster.flow.decode_streams import DecodeStreams, StartedDecode, WorkerStreamClosed
from cluster.flow.disaggregation import Disaggregation, PathChoice
from cluster.flow.kv_delivery import KVDelivery
from cluster.flow.recovery_costs import RecoveryCosts
from cluster.flow.request import (
    ClusterRequest,
    GenerationChunk,
    RequestFailedError,
    TransferFailedError,
)
from cluster.flow.router import Claim, LocalPrefill, NoLiveWorkerError, Router
from cluster.recoveries import Recovery, RecoveryPath
from engine.sampling_params import SamplingParams
from worker.messages import (
    DecodeRequest,
    ErrorEvent,
    ImportEvent,
    KVStream,
    PrefillRequest,
    PrefillResult,
    TokenEvent,
)

logger = logging.getLogger(__name__)

WORKER_FAILURES = (RayActorError, ActorUnavailableError, WorkerStreamClosed)
_PICK_RETRY_S = 0.1
REBUILD_REMOTE_MARGIN = 2.0
"""How much sooner the policy must predict a stream's rebuild on a prefill worker than on
its new decode worker. The remote path has hops the model leaves out (the prefill call,
the export, the import handshake) and runs right after a death, while the replacement
starts: with ~15-token prompts on a 2-core machine, streams rebuilt remotely resumed no
sooner than recomputed ones."""


class PrefillElsewhere(enum.Enum):
    """`_prefill_on_some_worker`'s answer when no prefill worker produced the first token:
    the request is prefilled where it decodes."""

    CHOSEN = enum.auto()
    """`disaggregation` chose the decode worker."""
    NO_PREFILL_WORKER = enum.auto()
    """No prefill worker was alive."""
    STREAM_CUT = enum.auto()
    """The prefill worker died mid-stream: the decode worker keeps the segments that
    landed and computes the rest."""


class RequestFlow:
    """One per cluster; `run` drives one `ClusterRequest` through the workers."""

    def __init__(
        self,
        config: ClusterConfig,
        router: Router,
        on_worker_failure: Callable[[WorkerInfo, str, int], None],
    ):
        self.config = config
        self.router = router
        self.on_worker_failure = on_worker_failure
        """The controller's `mark_dead(worker, why, generation)`: called when a call to a
        worker fails, with the incarnation the call went to."""
        self._recompute_warned: set[tuple[str, str]] = set()
        self.streams = DecodeStreams()
        """This driver's event streams from the decode workers, one per worker."""
        self.costs = RecoveryCosts()
        """Measured KV bandwidth and prefill rate; the cluster feeds it closed requests."""
        self.disaggregation = Disaggregation(
            config.disaggregation,
            router.views,
            config.prefill_chunk_size,
            config.block_size,
            config.transport.bandwidth_bytes_per_s,
            decode_chunk=config.decode_prefill_chunk,
            streamed=config.kv_streaming == "chunk",
        )
        self.delivery = KVDelivery(config, self.streams)
        """How prompts' KV reaches the decode workers: whole, or streamed (pulled, pushed)."""

    async def run(self, req: ClusterRequest) -> AsyncIterator[GenerationChunk]:
        if self.config.mode == "disaggregated":
            async for chunk in self._prefill_phase(req):
                yield chunk
                if chunk.finished:
                    return
        async for chunk in self._decode_phase(req):
            yield chunk

    # --- prefill ----------------------------------------------------------------------

    async def _prefill_phase(self, req: ClusterRequest) -> AsyncIterator[GenerationChunk]:
        if self.disaggregation.mode == "never":
            req.timeline.disaggregation = PathChoice("local", "never").as_dict()
            return
        result = await self._prefill_on_some_worker(req)
        if result is PrefillElsewhere.NO_PREFILL_WORKER:
            req.timeline.recoveries.append(Recovery.DECODE_SIDE_PREFILL)
            req.timeline.recovery_paths.append(RecoveryPath.DECODE_SIDE_PREFILL)
        if isinstance(result, PrefillElsewhere):
            return
        first = GenerationChunk(req.request_id, result.first)
        req.prompt_computed()
        req.decided += result.first.token_ids
        req.text_len += len(first.text)
        req.ticket = result.ticket
        if self.config.first_token_from == "prefill" or first.finished:
            yield first
        else:
            req.pending_first = first

    async def _prefill_on_some_worker(
        self, req: ClusterRequest
    ) -> PrefillResult | PrefillElsewhere:
        """First prefill worker that answers, or why the decode worker prefills instead."""
        retried = False
        while True:
            try:
                pick = self.router.pick(
                    "prefill", req.request_id, tokens=req.prompt_ids, salt=req.params.cache_salt
                )
            except NoLiveWorkerError:
                return PrefillElsewhere.NO_PREFILL_WORKER
            claim = req.claim(pick)
            self._pick_decode_peer(req)  # a retry picks both again
            _note_route(req, claim)
            if self._prefill_on_decode(req, claim, recovering=retried):
                claim.release()
                self._prefill_locally(req, req.decode_pick.worker, len(req.prompt_ids))
                if retried:
                    req.timeline.recovery_paths.append(RecoveryPath.DECODE_SIDE_PREFILL)
                return PrefillElsewhere.CHOSEN
            worker = claim.worker
            req.hold(worker)
            sent = time.monotonic()
            try:
                reply = await self._run_prefill(req, claim)
            except WORKER_FAILURES as exc:
                req.let_go(worker)
                self._failed(claim, exc, req, Recovery.PREFILL_DIED)
                if req.started_decode is not None:
                    self._cut_stream(req)
                    return PrefillElsewhere.STREAM_CUT
                retried = True
                continue
            finally:
                claim.release()
            if isinstance(reply, ErrorEvent):
                req.let_go(worker)
                raise RequestFailedError(req.request_id, reply.kind, reply.message)
            req.timeline.on_prefill(sent, time.monotonic(), reply)
            if retried:
                req.timeline.recovery_paths.append(RecoveryPath.PREFILL_RETRY)
            if reply.ticket is None:
                req.let_go(worker)
            else:
                req.exporter = worker
            return reply

    async def _run_prefill(self, req: ClusterRequest, claim: Claim) -> PrefillResult | ErrorEvent:
        """The prefill call; for a streamed request also the start of its decode and the
        relays of what the prefill makes (`KVDelivery.prefill`)."""
        return await self.delivery.prefill(req, claim.worker, self._prefill_request)

    def _cut_stream(self, req: ClusterRequest) -> None:
        """The prefill worker died mid-stream: the decode worker keeps what landed and
        computes the rest, which counts as queued there."""
        self.delivery.cut(req)
        req.timeline.recovery_paths.append(RecoveryPath.STREAM_KEPT)
        self._prefill_locally(req, req.started_decode_worker, len(req.prompt_ids))

    def _prefill_locally(self, req: ClusterRequest, decode: WorkerInfo, tokens: int) -> None:
        """`decode` will compute `tokens` of this request's KV itself: they count as queued
        there until its first token, so the next placement decision (a prompt under
        `auto`, the other streams of a dead decode worker) sees them."""
        if req.local_prefill is not None:
            req.local_prefill.release()
        req.local_prefill = req.claim(LocalPrefill(decode, tokens))

    def _pick_decode_peer(self, req: ClusterRequest) -> None:
        if req.decode_pick is not None:
            req.decode_pick.release()
        try:
            req.decode_pick = self.router.pick(
                "decode", req.request_id, tokens=req.prompt_ids, salt=req.params.cache_salt
            )
        except NoLiveWorkerError:
            req.decode_pick = None
        else:
            _note_route(req, req.decode_pick)

    def _prefill_on_decode(self, req: ClusterRequest, claim: Claim, recovering: bool) -> bool:
        decode = req.decode_pick.worker if req.decode_pick is not None else None
        choice = self.disaggregation.choose(
            req.prompt_ids, claim.worker, decode, recovering, req.params.cache_salt
        )
        req.timeline.disaggregation = choice.as_dict()
        return choice.path == "local"

    def _prefill_request(
        self, req: ClusterRequest, stream: KVStream = KVStream.WHOLE, per_chunk: bool = True
    ) -> PrefillRequest:
        peer = req.decode_pick.worker.worker_id if req.decode_pick else ""
        return PrefillRequest(
            req.request_id,
            req.prompt_ids,
            req.params,
            peer,
            req.timeline.arrival,
            stream,
            per_chunk,
        )

    # --- decode -----------------------------------------------------------------------

    async def _decode_phase(self, req: ClusterRequest) -> AsyncIterator[GenerationChunk]:
        role = "colocated" if self.config.mode == "colocated" else "decode"
        rebuild = False
        while True:
            claim = await self._decode_claim(req, role, predict=not rebuild)
            req.timeline.decode_worker = claim.worker.worker_id
            if rebuild:
                path = await self._rebuild_kv(req, claim.worker)
                req.timeline.recovery_paths.append(path)
                if path == RecoveryPath.RECOMPUTE and self.config.mode == "disaggregated":
                    self._prefill_locally(req, claim.worker, len(req.kv_tokens))
            try:
                async for chunk in self._decode_on(claim, req):
                    yield chunk
                return
            except WORKER_FAILURES as exc:
                req.let_go(claim.worker)
                self._failed(claim, exc, req, Recovery.died(role))
                rebuild = not self._repull_pays(req)
                if not rebuild:
                    req.timeline.recovery_paths.append(RecoveryPath.REPULL)

    def _repull_pays(self, req: ClusterRequest) -> bool:
        """The next decode worker re-pulls the still-pinned export and computes only the
        tokens decided since, when the measured costs say that is sooner than building
        the KV again (`_rebuild_kv`); otherwise the export is released."""
        exporter = req.exporter
        if req.ticket is not None and exporter is not None and exporter.alive:
            kv_bytes = req.ticket.nbytes
            if self.costs.choose(len(req.prompt_ids), len(req.decided), kv_bytes) == "repull":
                return True
        req.release_export()
        return False

    async def _rebuild_kv(self, req: ClusterRequest, decode: WorkerInfo) -> RecoveryPath:
        """After a decode worker died with no export left to re-pull, the KV of the prompt
        and of every decided token but the last is computed again: on the prefill worker
        whose prefix cache still holds most of the prompt, which exports it to `decode`
        (`reprefill`), or by `decode` itself (`recompute`), as the disaggregation policy
        predicts (queues, cache hits, transfer, the stall of the streams `decode` runs),
        remote only by `REBUILD_REMOTE_MARGIN`. Returns the path; a reprefill that fails
        falls back."""
        if self.config.mode != "disaggregated" or self.disaggregation.mode == "never":
            return RecoveryPath.RECOMPUTE
        tokens = req.kv_tokens
        salt = req.params.cache_salt
        try:
            claim = self.router.pick_holder("prefill", req.request_id, tokens, salt)
        except NoLiveWorkerError:
            return RecoveryPath.RECOMPUTE
        choice = self.disaggregation.choose(tokens, claim.worker, decode, True, salt)
        logger.debug(
            "request %s: KV of %d tokens to rebuild: %s", req.request_id, len(tokens), choice
        )
        self.router.views.note_tokens(decode.worker_id, tokens, salt)  # either way
        if not _remote_rebuild_pays(choice):
            claim.release()
            return RecoveryPath.RECOMPUTE
        worker = req.claim(claim).worker
        req.hold(worker)
        params = kv_only(req.params, len(req.decided))
        try:
            reply = await worker.handle.prefill.remote(
                PrefillRequest(
                    req.request_id, tokens, params, decode.worker_id, req.timeline.arrival
                )
            )
        except WORKER_FAILURES as exc:
            req.let_go(worker)
            self._failed(claim, exc, req, Recovery.PREFILL_DIED)
            return RecoveryPath.RECOMPUTE
        finally:
            claim.release()
        if isinstance(reply, ErrorEvent) or reply.ticket is None:
            req.let_go(worker)
            return RecoveryPath.RECOMPUTE
        req.ticket, req.exporter = reply.ticket, worker
        return RecoveryPath.REPREFILL

    async def _decode_claim(self, req: ClusterRequest, role: str, predict: bool = True) -> Claim:
        """The decode worker chosen with the prefill (the ticket names it) goes first,
        with the claim taken at that pick; picking again would also advance round_robin
        twice per request. Otherwise a fresh pick, waiting for a live worker (`predict`:
        as `Router.pick`)."""
        pick, req.decode_pick = req.decode_pick, None
        if pick is not None and pick.worker.alive:
            return req.claim(pick)
        if pick is not None:
            pick.release()
        claim = await self._pick_waiting(role, req, req.prompt_ids + req.decided, predict)
        _note_route(req, claim)
        return req.claim(claim)

    async def _decode_on(self, claim: Claim, req: ClusterRequest):
        worker = claim.worker
        req.hold(worker)
        events, sent = self._take_started(req, worker), req.started_decode_at
        try:
            if events is None:
                sent = time.monotonic()
                events = await self.streams.start(worker, self._decode_request(req))
            async for item in events:
                if isinstance(item, ImportEvent):
                    self._on_imported(req, sent, item)
                elif isinstance(item, ErrorEvent):
                    req.let_go(worker)
                    raise _request_error(item)
                else:
                    for chunk in self._on_tokens(req, item, worker):
                        yield chunk
                    if item.finished:
                        # Done: not waiting for more, where the worker's death
                        # would read as this request's and decode it again.
                        return
        finally:
            if events is not None:
                events.close()
            claim.release()

    @staticmethod
    def _take_started(req: ClusterRequest, worker: WorkerInfo) -> StartedDecode | None:
        """The events of the decode request sent ahead of a streamed prefill, if it went
        to `worker` (its first decode attempt); any other is dropped here."""
        started, req.started_decode = req.started_decode, None
        if started is not None and started.worker_id != worker.worker_id:
            started.close()
            return None
        return started

    @staticmethod
    def _decode_request(req: ClusterRequest) -> DecodeRequest:
        return DecodeRequest(
            req.request_id,
            req.prompt_ids,
            list(req.decided),
            req.params,
            req.text_len,
            req.ticket,
            req.timeline.arrival,
        )

    def _on_tokens(self, req: ClusterRequest, item: TokenEvent, worker: WorkerInfo):
        if req.local_prefill is not None:  # its prompt is computed: no longer queued
            req.local_prefill.release()
            req.local_prefill = None
        if req.pending_first is not None:
            first, req.pending_first = req.pending_first, None
            yield first
        req.decided += item.token_ids
        req.text_len += len(item.text)
        req.timeline.on_local_prefill(item.num_cached_tokens)
        if item.prompt_logprobs is not None:
            req.prompt_computed()
        if item.finished:
            req.let_go(worker)
        yield GenerationChunk(req.request_id, item)

    async def _pick_waiting(
        self, role: str, req: ClusterRequest, tokens: list[int], predict: bool = True
    ) -> Claim:
        """A live worker of `role`, waiting up to `recovery_timeout_s` for one to come back."""
        deadline = time.monotonic() + self.config.recovery_timeout_s
        while True:
            try:
                return self.router.pick(
                    role, req.request_id, tokens=tokens, salt=req.params.cache_salt, predict=predict
                )
            except NoLiveWorkerError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(_PICK_RETRY_S)

    def _on_imported(self, req: ClusterRequest, sent: float, event: ImportEvent) -> None:
        req.timeline.on_import(sent, time.monotonic(), event)
        if event.ok:
            exporter, req.exporter, req.ticket = req.exporter, None, None
            if exporter is not None:
                req.let_go(exporter)
                if exporter.alive:
                    exporter.handle.ack.remote(req.request_id)
            return
        prefill = req.exporter.worker_id if req.exporter else "?"
        req.release_export()
        if event.stream is not None and event.stream.cut:
            # The prefill worker died mid-stream: what landed was kept, the rest computed
            # on the decode worker whatever the policy (recorded here unless this driver
            # saw the death first and cut the stream itself).
            req.timeline.recomputed = True
            if RecoveryPath.STREAM_KEPT not in req.timeline.recovery_paths:
                req.timeline.recoveries.append(Recovery.TRANSFER_FAILED)
                req.timeline.recovery_paths.append(RecoveryPath.STREAM_KEPT)
            return
        if self.config.on_transfer_failure == "recompute":
            req.timeline.recomputed = True
            req.timeline.recoveries.append(Recovery.TRANSFER_FAILED)
            req.timeline.recovery_paths.append(RecoveryPath.RECOMPUTE)
            self._warn_recompute(prefill, event)

    def _warn_recompute(self, prefill: str, event: ImportEvent) -> None:
        """Once per worker pair: a decode worker that keeps recomputing instead of
        importing looks healthy in every other way."""
        pair = (prefill, event.worker_id)
        if pair in self._recompute_warned:
            return
        self._recompute_warned.add(pair)
        logger.warning(
            "KV import %s -> %s failed (%s: %s); the decode worker recomputes the prompt. "
            "Further fallbacks on this pair are counted in pdserve_kv_recomputes_total.",
            prefill,
            event.worker_id,
            event.reason,
            event.message,
        )

    def _failed(self, claim: Claim, exc: BaseException, req: ClusterRequest, what: Recovery):
        worker = claim.worker
        logger.warning("request %s: %s (%s): %r", req.request_id, what, worker.worker_id, exc)
        req.timeline.recoveries.append(what)
        self.on_worker_failure(worker, repr(exc), claim.generation)


def _remote_rebuild_pays(choice: PathChoice) -> bool:
    """A rebuild goes to a prefill worker only when the policy predicts it
    `REBUILD_REMOTE_MARGIN` times sooner (or has measured nothing yet, as for prompts)."""
    if choice.path != "remote":
        return False
    if choice.remote_s is None or choice.local_s is None:
        return True
    return choice.remote_s * REBUILD_REMOTE_MARGIN < choice.local_s


def kv_only(params: SamplingParams, num_decided: int) -> SamplingParams:
    """What a prefill that only rebuilds KV runs with: the token it samples is thrown
    away (it is already decided), so nothing may end the request there or cost extra
    (stops, grammar, logprobs), and its length check covers the same total."""
    return dataclasses.replace(
        params,
        max_tokens=max(2, params.max_tokens - max(num_decided - 1, 0)),
        min_tokens=0,
        ignore_eos=True,
        stop=(),
        stop_token_ids=(),
        logprobs=None,
        prompt_logprobs=None,
        structured=None,
    )


def _note_route(req: ClusterRequest, claim: Claim) -> None:
    if claim.decision is not None:
        req.timeline.route[claim.decision.role] = claim.decision.as_dict()


def _request_error(event: ErrorEvent) -> RequestFailedError:
    if event.kind == "transfer_failed":
        return TransferFailedError(event.request_id, event.message)
    return RequestFailedError(event.request_id, event.kind, event.message)
