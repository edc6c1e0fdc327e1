"""What crosses Ray between the driver and the workers: small typed dataclasses.

    driver ── PrefillRequest ──> prefill worker ── PrefillResult | ErrorEvent ──> driver
    driver ── DecodeRequest ──> decode worker ── ImportEvent, TokenEvent..., ending
                                                  with a finished TokenEvent or an
                                                  ErrorEvent, in the driver's one
                                                  stream from that worker, a batch of
                                                  (request id, event) per step
    controller ── check_health() ──> any worker ── HealthReport

Timings are durations measured on the worker's own monotonic clock, never wall-clock
stamps: the driver composes them with its own monotonic stamps, so clock skew between
nodes cannot shift or hide a phase.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError
from engine.sampling_params import SamplingParams
from engine.sequence import TokenDelta


class KVStream(enum.StrEnum):
    """How one request's KV moves from its prefill worker to its decode worker."""

    WHOLE = "whole"
    """After the whole prompt is prefilled: one export, whose ticket goes to the decode
    request, one pull."""
    PULL = "pull"
    """Chunk-streamed: each prefill chunk's completed blocks are exported as a segment,
    whose ticket the driver relays to the decode worker, which pulls it at once."""
    PUSH = "push"
    """The decode worker reserves its blocks and opens one transfer as the request
    arrives, before any KV exists; the prefill worker's sender sends each segment down
    it as soon as it is exported (each chunk's, or the whole prompt's at the end): no
    ticket relayed, no request per segment."""


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    peer_id: str
    """The decode worker the export is meant for (the lease's expected reader)."""
    arrival: float | None = None
    """When the request reached the cluster (the driver's clock): its place in the
    prefill queue, so a stream rebuilt after its decode worker died goes ahead of the
    prompts that came after it."""
    kv_stream: KVStream = KVStream.WHOLE
    """How the export reaches the decode worker (`KVStream`)."""
    per_chunk: bool = True
    """With `PUSH`: export each prefill chunk's blocks as its step ends (False: all of
    them at once after the last chunk, pushed as one segment)."""


@dataclass(frozen=True)
class PrefillResult:
    """The first token and, unless the request already finished, the export ticket."""

    request_id: str
    worker_id: str
    first: TokenDelta
    """The first token as the engine made it: its text, whether it finished the request,
    its logprobs, the prompt's logprobs, the prompt tokens the prefix cache held."""
    num_prompt_tokens: int
    ticket: Any | None
    """`kv_transfer.ExportTicket` of the pinned blocks; the decode worker pulls them."""
    queue_s: float
    """Arrival at the worker until the scheduler gave the prompt compute."""
    prefill_s: float
    """From then until the first token was sampled."""
    export_s: float
    """From the first token until the export ticket was ready (0 when none)."""
    segment: Any | None = None
    """A streamed export: the ticket of its final segment (the blocks the last chunk
    completed, the partial block included); `ticket` is then the whole export's."""
    segments: int = 0
    """Segments the streamed export was published in (0: not streamed)."""


@dataclass(frozen=True)
class SegmentPublished:
    """Prefill worker -> driver, in `prefill_streamed` (`KVStream.PULL`): one prefill
    chunk's completed blocks were exported; the driver relays the ticket at once."""

    request_id: str
    ticket: Any
    """`kv_transfer.ExportTicket` with `segment` set."""


@dataclass(frozen=True)
class StreamUpdate:
    """Driver -> decode worker (`DecodeWorker.stream_update`), for a request sent with a
    streamed `kv_stream`: a segment to pull, the final segment with the tokens the
    prefill worker decided, or the end of a stream cut short."""

    request_id: str
    segment: Any | None = None
    """`kv_transfer.ExportTicket` of one segment (`KVStream.PULL`); None with push."""
    output_token_ids: list[int] | None = None
    """Set once the prompt is prefilled: the tokens the prefill worker sampled (its first
    token). The import completes only once they and every block arrived."""
    emitted_text_len: int = 0
    """Characters of their text the client already has (or is about to)."""
    cut: bool = False
    """The prefill worker died before the final segment: keep the blocks that landed and
    were verified, compute the rest here."""


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens already decided (by prefill or an earlier decode worker)."""
    params: SamplingParams
    emitted_text_len: int
    """Characters of their text the client already has."""
    ticket: Any | None = None
    """Export ticket to import the prompt's KV from; None prefills here (colocated,
    recovery, decode-side prefill)."""
    arrival: float | None = None
    """When the request reached the cluster, on the driver's clock: its place in line."""
    kv_stream: KVStream = KVStream.WHOLE
    """`PULL` / `PUSH`: sent before the prompt is prefilled, with no ticket. The import of
    the prompt's KV starts at once (blocks reserved), fed by `StreamUpdate`s (pull: the
    segments; both: the prefill's tokens) or by the transfer it opens (push)."""
    push_from: Any | None = None
    """`KVStream.PUSH`: the ticket of no blocks (`ExportTicket` with the prefill worker's
    endpoint, layout, checksum algorithm) that the standing transfer starts from."""


@dataclass(frozen=True)
class StreamReceipt:
    """What a streamed import overlapped, on the decode worker's clock: the part of the
    transfer hidden behind the prefill's compute and the part exposed after it."""

    segments: int
    """Segments pulled (or pushed), the prefix cache's wholly held ones excluded."""
    hidden_s: float
    """Transfer time spent before the final segment arrived, i.e. while the prefill
    worker still computed the prompt's last chunk (or earlier)."""
    exposed_s: float
    """From the final segment's arrival until the last block landed: what the link still
    adds to the time until decode can start."""
    first_landed_before_final_s: float | None
    """How long before the final segment arrived the first segment had landed (>0: the
    transfer overlapped the compute); None when none landed first."""
    first_landed_at: float | None = None
    """The decode worker's monotonic clock when the first segment landed: comparable with
    another worker's stamps on one node only (tests, the overlap proof)."""
    kept_blocks: int = 0
    """An import that did not complete: its leading blocks kept (landed in order, each
    verified), not recomputed."""
    cut: bool = False
    """The stream was cut short: its prefill worker died before the final segment, and
    the decode worker computes the rest whatever `on_transfer_failure` says."""


@dataclass(frozen=True)
class ImportEvent:
    """First item of a decode stream that was given a ticket: how the import went."""

    ok: bool
    transport: str
    num_bytes: int
    reason: str | None
    """`kv_transfer.FailureReason` value when it failed."""
    message: str
    admission_s: float
    """Waiting for free blocks in the decode pool."""
    transfer_s: float
    """Moving the bytes (the receiver's fetch)."""
    worker_id: str
    reused_blocks: int = 0
    """Leading blocks of the export the decode worker's prefix cache already held: not
    moved (its hits, stated in the pull)."""
    moved_blocks: int = 0
    """Blocks the transfer wrote (`num_bytes` = moved_blocks x block bytes; across
    tensor-parallel layouts, the bytes every rank pulled, staged slices whole)."""
    slices: tuple = ()
    """`kv_transfer.SliceReceipt` per head slice, where the import went between
    tensor-parallel layouts: sender rank, receiver rank, KV heads, bytes, checksum."""
    stream: StreamReceipt | None = None
    """A streamed import's overlap (None: the whole prompt moved after its prefill, and
    all of `transfer_s` was exposed)."""


TokenEvent = TokenDelta
"""A decode stream's tokens: the engine's record of one step, sent on as it is. Its
`num_cached_tokens` is what the decode worker's prefix cache held when it computed the
request's KV itself (decode-side prefill, recovery); `prompt_logprobs` come on the
first event of a request whose prompt was computed here and that asked."""


@dataclass(frozen=True)
class ErrorEvent:
    """A request failed inside a worker. `kind` is an `EngineError.kind` or
    `transfer_failed`, which the frontend maps to a status code."""

    request_id: str
    kind: str
    message: str

    @classmethod
    def of(cls, request_id: str, exc: BaseException) -> ErrorEvent:
        if isinstance(exc, EngineError):
            return cls(request_id, exc.kind, exc.message)
        return cls(request_id, "internal", f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class HealthReport:
    """A worker's answer to `check_health`: the router reads its load, metrics the rest."""

    worker_id: str
    role: str
    queue_depth: int
    free_blocks: int
    total_blocks: int
    num_running: int
    num_waiting: int
    num_threads: int
    pid: int
    node_id: str | None = None
    cpu_cores: tuple[int, ...] = ()
    """The cores the worker's engine thread may run on (`pin_cores`)."""
    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)
    """`prefill` / `decode` -> {batch size: steps}."""
    gpu: dict | None = None
    transfer: Any | None = None
    """`kv_transfer` SenderStats (prefill) or ReceiverStats (decode); None colocated."""
    startup: dict[str, float] = field(default_factory=dict)
    """How this worker's start went, in seconds: `process_s` (process start to the
    actor's constructor: interpreter, imports), `engine_s` (weights and KV pool),
    `transport_s` (KV servers)."""
    last_transfer: dict[str, str] = field(default_factory=dict)
    """Decode workers: prefill worker id -> how its last request's KV arrived
    (a transport name, or `recomputed` when it was prefilled here instead)."""
    prefix_cache: Any | None = None
    """`engine.prefix_cache.CacheReport`: the block hashes held and hit counters (None
    with prefix caching off). The cache-aware router scores prompts against it."""
    step_costs: Any | None = None
    """`engine.step_costs.StepCosts`: this engine's measured step time per prefill
    token and per decode sequence (None until it has run such steps)."""
    cpu_s: float = 0.0
    """CPU seconds (user + system, every thread) the worker process has used so far."""
    tp_size: int = 1
    """Tensor-parallel ranks of this worker (`pid` is rank 0's process)."""
    rank_pids: tuple[int, ...] = ()
    """The processes of ranks 1..tp_size-1, in rank order (drills kill them too)."""
