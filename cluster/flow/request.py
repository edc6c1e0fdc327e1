"""The driver's one owner of a request: its ids, params, timeline, progress and claims.

Lifecycle (frontend or Python API):
    PDCluster.open_request -> ClusterRequest (admitted, nothing sent yet)
    -> the request flow runs it: every worker call that leaves state behind on a
       worker (a queued prefill, an export, an import, a decode sequence) is recorded
       with `hold`, and let go once that state is gone (`let_go`)
    -> `close(reason)`, exactly once, however it ended (finished, client disconnect,
       timeout, error): an abort goes to every worker still holding something, every
       claim is released, and the observers (metrics) run.
Nothing else aborts a request or releases a claim, so no path can leak one or do it
twice.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.control.worker_info import WorkerInfo
from cluster.flow.decode_streams import StartedDecode
from cluster.flow.router import Claim, LocalPrefill
from cluster.timeline import RequestTimeline
from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import TokenDelta

logger = logging.getLogger(__name__)


class CloseReason(enum.StrEnum):
    """Why a request was closed. The values are the strings the frontend's outcome
    metric and logs have always shown (a `StrEnum` is its value wherever it is printed,
    compared or written to JSON)."""

    FINISHED = "finished"
    CANCELLED = "cancelled"
    """The caller went away."""
    TIMEOUT = "timeout"
    """Past `request_timeout_s`."""
    ERROR = "error"
    SHUTDOWN = "shutdown"
    """Cut at the end of the server's drain (`cluster.api.drain`)."""


class RequestFailedError(RuntimeError):
    """A worker refused or failed the request. `kind` is the worker's `ErrorEvent` kind
    (invalid_request, aborted, transfer_failed, internal), which the frontend maps to a
    status code."""

    def __init__(self, request_id: str, kind: str, message: str):
        self.request_id = request_id
        self.kind = kind
        self.message = message
        super().__init__(f"[request {request_id}] {message}")


class TransferFailedError(RequestFailedError):
    """KV transfer failed and the policy is `fail`."""

    def __init__(self, request_id: str, message: str):
        super().__init__(request_id, "transfer_failed", message)


@dataclass
class GenerationChunk:
    """One streamed piece of a generation, as the Python API and the frontend see it:
    the engine's token record as a worker sent it, and what the driver adds. The
    record's fields read through (`chunk.token_ids`, `chunk.text`, ...)."""

    request_id: str
    tokens: TokenDelta
    """The first token from the prefill worker, or a decode step's tokens."""
    num_prompt_tokens: int = 0
    timings: dict = field(default_factory=dict)
    """Set on the final chunk: the per-phase breakdown (`RequestTimeline.breakdown`)."""

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.token_ids

    @property
    def text(self) -> str:
        return self.tokens.text

    @property
    def finished(self) -> bool:
        return self.tokens.finished

    @property
    def finish_reason(self) -> str | None:
        return self.tokens.finish_reason

    @property
    def num_output_tokens(self) -> int:
        return self.tokens.num_output_tokens

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """Logprobs of `token_ids`, when the request asked for them."""
        return self.tokens.logprobs

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """On the first chunk, when the request asked for prompt logprobs (`echo`)."""
        return self.tokens.prompt_logprobs


class ClusterRequest:
    """Created by `PDCluster.open_request`; run by `RequestFlow`; closed once."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timeline: RequestTimeline,
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.timeline = timeline
        timeline.num_prompt_tokens = len(prompt_ids)
        self.decided: list[int] = []
        """Token ids fixed for this request (sampled by some worker), in order."""
        self.text_len = 0
        """Characters of text of the decided tokens, as streamed (or about to be)."""
        self.pending_first: GenerationChunk | None = None
        """The prefill's first token when it is streamed only once decode starts."""
        self.ticket = None
        """The export ticket of the prompt's KV, while a decode worker may still pull it."""
        self.exporter: WorkerInfo | None = None
        """The prefill worker whose lease holds that export."""
        self.decode_pick: Claim | None = None
        self.local_prefill: LocalPrefill | None = None
        """Set when `auto` sent the prompt to the decode worker to prefill."""
        """The decode worker picked together with the prefill worker (the export's peer)."""
        self.started_decode: StartedDecode | None = None
        """A streamed request's decode, sent ahead of its prefill, until the decode phase
        reads its events (`RequestFlow._take_started`)."""
        self.started_decode_worker: WorkerInfo | None = None
        self.started_decode_at: float | None = None
        self.last_chunk: GenerationChunk | None = None
        self.close_reason: CloseReason | None = None
        self.on_close: list[Callable[[ClusterRequest], None]] = []
        """Observers, run once at close (metrics, the frontend's admission count)."""
        self._claims: list[Claim] = []
        self._holders: dict[str, WorkerInfo] = {}

    @property
    def kv_tokens(self) -> list[int]:
        """The prompt and every decided token but the last: what a worker must hold the
        KV of to continue the stream (the last one's KV is computed by the next step)."""
        return self.prompt_ids + self.decided[:-1]

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    # --- what the flow records ----------------------------------------------------------

    def claim(self, claim: Claim | LocalPrefill):
        """Track a claim from `Router.pick` (or a decode worker's `LocalPrefill`); close
        releases it if the flow did not."""
        self._claims.append(claim)
        return claim

    def hold(self, worker: WorkerInfo) -> None:
        """`worker` now holds state for this request (abort it there on close)."""
        self._holders[worker.worker_id] = worker

    def let_go(self, worker: WorkerInfo) -> None:
        """`worker` holds nothing for this request any more (finished, acked, dead)."""
        self._holders.pop(worker.worker_id, None)

    def prompt_computed(self) -> None:
        """The prompt's logprobs (if asked) have been delivered: a worker that computes
        the prompt again (recovery, migration) must not send them twice."""
        if self.params.prompt_logprobs is not None:
            self.params = dataclasses.replace(self.params, prompt_logprobs=None)

    def release_export(self) -> None:
        """The prompt's exported KV is not needed (imported elsewhere, or recomputed):
        its blocks are returned now rather than at lease expiry."""
        exporter, self.exporter, self.ticket = self.exporter, None, None
        if exporter is not None:
            self._abort_on(exporter)
            self.let_go(exporter)

    # --- the end --------------------------------------------------------------------------

    def close(self, reason: CloseReason) -> None:
        """Idempotent. Aborts whatever is live on any worker, releases every claim, runs
        the observers. Called by `PDCluster.run` when the stream ends and by the frontend
        when the client goes away; never blocks."""
        if self.closed:
            return
        self.close_reason = CloseReason(reason)
        if self.started_decode is not None:  # never read: stop collecting its events
            self.started_decode.close()
            self.started_decode = None
        for worker in list(self._holders.values()):
            self._abort_on(worker)
        self._holders.clear()
        for claim in self._claims:
            claim.release()
        if self.decode_pick is not None:
            self.decode_pick.release()
        for observer in self.on_close:
            try:
                observer(self)
            except Exception:  # an observer must not stop the others
                logger.exception("[request %s] close observer failed", self.request_id)

    def _abort_on(self, worker: WorkerInfo) -> None:
        if worker.alive:
            worker.handle.abort.remote(self.request_id)
