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

from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError
from engine.sampling_params import SamplingParams
from engine.sequence import TokenDelta


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
