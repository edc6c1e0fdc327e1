"""Prefill remotely (on a prefill worker, then move the KV) or locally (on the decode
worker), decided per request from what the cluster measured.

Lifecycle: the request flow picks a (prefill, decode) pair, then asks `choose`;
`disaggregation: always` answers remote, `never` local, `auto` compares the predicted
time until the request can decode on its decode worker, each way:

    remote = the prefill worker's queue (prompt tokens claimed ahead of this one)
           + its prefill of the tokens its prefix cache lacks (fixed cost per chunk
             + per-token cost, from its own step trace: engine/step_costs.py)
           + call overhead (measured: the prefill call's span minus the worker's phases)
           + the transfer of the blocks the decode worker's cache lacks, at the link's
             measured bandwidth (before any measurement: the configured cap, if any);
             streamed (`kv_streaming: chunk`), only the part the prefill's compute does
             not hide: each chunk's blocks move while the next chunk computes
    local  = the prompts already sent to the decode worker to prefill there (queued
             ahead of this one) + the decode worker's prefill of the tokens its own
             cache lacks. With a
             running batch the pieces ride in its decode steps, whose fixed cost is paid
             anyway, and every running stream waits as long: that stall counts once
             more (`INTERFERENCE_WEIGHT`). An idle decode worker pays the fixed cost
             and stalls nobody.

The choice, its reason and both predictions go into the request's `pdserve_timings`
(`disaggregation`), the log (debug) and `pdserve_disaggregation_decisions_total`.
With no prefill step measured yet, `auto` goes remote (and measures). The crossover
(`crossover_prompt_len`) is what `pdserve bench bandwidth` plots.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from cluster.flow.cache_views import CacheViews
from engine.block_manager import blocks_needed
from engine.step_costs import StepCosts

logger = logging.getLogger(__name__)

INTERFERENCE_WEIGHT = 1.0
"""How much one second of stall of the running decode batch weighs against one second
of this request's own wait (1: as if one more request waited)."""
DEFAULT_BANDWIDTH = 2e9
"""KV link bandwidth assumed before any transfer was measured (an uncapped same-node link)."""
DEFAULT_OVERHEAD_S = 0.005
SMOOTHING = 0.2
"""Weight of the newest sample in the running averages."""
MIN_BANDWIDTH_SAMPLE = 1 << 20
"""Transfers smaller than this are latency, not bandwidth: not sampled."""


@dataclass(frozen=True)
class PathInputs:
    """Everything one prediction depends on (built by `Disaggregation`, or by hand in the
    bandwidth sweep's crossover plot and in tests)."""

    prompt_tokens: int
    block_size: int
    block_bytes: int
    prefill_costs: StepCosts
    decode_costs: StepCosts | None
    bandwidth: float
    prefill_chunk: int
    """Longest prompt piece of a prefill worker's step."""
    decode_chunk: int | None = None
    """Longest prompt piece the decode worker prefills in one step (None: `prefill_chunk`);
    on CPUs under `auto` shorter than the prefill workers' (`decode_step_tokens`)."""
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0
    prefill_queue_tokens: int = 0
    decode_queue_tokens: int = 0
    """Prompt tokens the decode worker was already asked to prefill itself."""
    decode_running: int = 0
    overhead_s: float = DEFAULT_OVERHEAD_S
    streamed: bool = False
    """The KV moves chunk by chunk as the prefill goes (`kv_streaming: chunk`)."""


@dataclass(frozen=True)
class PathChoice:
    path: str
    """`remote` or `local`."""
    reason: str
    """`always`, `never`, `unmeasured` (auto without a measured prefill yet), `cheaper`,
    `recovery` (`always` comparing both paths for a request whose prefill worker died)."""
    remote_s: float | None = None
    local_s: float | None = None
    moved_blocks: int | None = None
    bandwidth: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _prefill_s(costs: StepCosts, tokens: int, chunk: int, fixed: bool = True) -> float:
    chunks = -(-tokens // chunk) if fixed else 0
    return (costs.prefill_fixed_s or 0.0) * chunks + (costs.prefill_token_s or 0.0) * tokens


def exposed_transfer_s(compute_s: float, transfer_s: float, chunks: int) -> float:
    """The transfer time left after a prefill of `chunks` chunks when each chunk's blocks
    move once its step ends (an even split: the pipeline finishes at the later of the
    compute plus one chunk's transfer and one chunk's compute plus the transfer)."""
    chunks = max(1, chunks)
    finish = max(compute_s + transfer_s / chunks, compute_s / chunks + transfer_s)
    return finish - compute_s


def predict(inputs: PathInputs) -> tuple[float, float, int]:
    """(remote seconds, local seconds, blocks the remote path moves)."""
    p, d = inputs.prefill_costs, inputs.decode_costs
    if d is None or d.prefill_token_s is None:
        d = p  # same model on both pools: the prefill workers' measurement stands in
    n = inputs.prompt_tokens
    remote_tokens = max(1, n - inputs.prefill_cached_tokens)
    local_tokens = max(1, n - inputs.decode_cached_tokens)
    moved = max(
        0, blocks_needed(n, inputs.block_size) - inputs.decode_cached_tokens // inputs.block_size
    )
    compute = _prefill_s(p, remote_tokens, inputs.prefill_chunk)
    transfer = moved * inputs.block_bytes / inputs.bandwidth
    if inputs.streamed:
        transfer = exposed_transfer_s(compute, transfer, -(-remote_tokens // inputs.prefill_chunk))
    remote = (
        (p.prefill_token_s or 0.0) * inputs.prefill_queue_tokens
        + compute
        + inputs.overhead_s
        + transfer
    )
    queued = (d.prefill_token_s or 0.0) * inputs.decode_queue_tokens
    decode_chunk = inputs.decode_chunk or inputs.prefill_chunk
    if inputs.decode_running > 0:
        own = _prefill_s(d, local_tokens, decode_chunk, False)
        local = queued + (1 + INTERFERENCE_WEIGHT) * own
    else:
        local = queued + _prefill_s(d, local_tokens, decode_chunk)
    return remote, local, moved


def crossover_prompt_len(inputs: PathInputs, max_tokens: int, step: int = 16) -> int | None:
    """The shortest prompt (multiple of `step`, up to `max_tokens`) that `auto` sends
    remote under `inputs` (its `prompt_tokens` ignored); None when none is."""
    for n in range(step, max_tokens + 1, step):
        remote, local, _ = predict(dataclasses.replace(inputs, prompt_tokens=n))
        if remote < local:
            return n
    return None


@dataclass
class PathCosts:
    """Running measurements the cluster feeds with every closed request (`observe`)."""

    bandwidth: dict[tuple[str, str], float] = field(default_factory=dict)
    """(prefill worker, decode worker) -> achieved KV bandwidth, bytes/s."""
    overhead_s: float = DEFAULT_OVERHEAD_S
    block_bytes: int | None = None
    configured_bandwidth: float | None = None
    """The transport's configured cap, the prior before a link is measured."""

    def observe(self, timeline) -> None:
        """Called once per closed request (`PDCluster.on_finish`)."""
        if timeline.kv_block_bytes:
            self.block_bytes = timeline.kv_block_bytes
        imported, prefill = timeline.imported, timeline.prefill
        measurable = imported is not None and imported.ok and imported.transfer_s > 0
        if measurable and imported.num_bytes >= MIN_BANDWIDTH_SAMPLE:
            link = (timeline.prefill_worker or "", timeline.decode_worker or "")
            sample = imported.num_bytes / imported.transfer_s
            self.bandwidth[link] = _blend(self.bandwidth.get(link), sample)
        overhead = timeline.ttft_parts().get("prefill_call_overhead_s")
        if prefill is not None and overhead is not None and overhead >= 0:
            self.overhead_s = _blend(self.overhead_s, overhead + prefill.export_s)

    def link_bandwidth(self, prefill_id: str, decode_id: str) -> float:
        measured = self.bandwidth.get((prefill_id, decode_id))
        return measured or self.configured_bandwidth or DEFAULT_BANDWIDTH


class Disaggregation:
    """One per request flow; `choose` is called once per disaggregated request."""

    def __init__(
        self,
        mode: str,
        views: CacheViews,
        prefill_chunk: int,
        block_size: int,
        configured_bandwidth: float | None = None,
        decode_chunk: int | None = None,
        streamed: bool = False,
    ):
        self.mode = mode
        self.streamed = streamed
        """Prompts' KV streams chunk by chunk: only its exposed part delays the remote path."""
        self.views = views
        self.prefill_chunk = prefill_chunk
        self.decode_chunk = decode_chunk
        self.block_size = block_size
        self.costs = PathCosts(configured_bandwidth=configured_bandwidth)

    def choose(
        self,
        tokens: list[int],
        prefill,
        decode,
        recovering: bool = False,
        salt: str | None = None,
    ) -> PathChoice:
        """`prefill`, `decode`: the picked workers' `WorkerInfo` (decode may be None).
        `recovering`: the request's prefill worker died under it. Then `always` compares
        the two paths as `auto` does: the survivors' queues just grew by the dead
        worker's prompts, and its own decode worker may well be the sooner way out."""
        if self.mode == "never":
            return PathChoice("local", "never")
        if (self.mode == "always" and not recovering) or decode is None:
            return PathChoice("remote", "always")
        inputs = self.inputs(tokens, prefill, decode, salt)
        if inputs is None:
            return PathChoice("remote", "unmeasured")
        remote, local, moved = predict(inputs)
        path = "local" if local < remote else "remote"
        reason = "recovery" if self.mode == "always" else "cheaper"
        choice = PathChoice(path, reason, remote, local, moved, inputs.bandwidth)
        logger.debug("%d-token prompt: %s", len(tokens), choice)
        return choice

    def inputs(
        self, tokens: list[int], prefill, decode, salt: str | None = None
    ) -> PathInputs | None:
        prefill_costs = getattr(prefill.load, "step_costs", None)
        if prefill_costs is None or prefill_costs.prefill_token_s is None:
            return None
        hashes = self.views.hashes(tokens, [prefill, decode], salt)
        size = self.views.block_size or self.block_size
        on_decode = self.views.cached_blocks(decode, hashes) * size
        on_prefill = self.views.cached_blocks(prefill, hashes) * size
        own_work = len(tokens) - on_prefill  # already in the prefill worker's claims
        return PathInputs(
            prompt_tokens=len(tokens),
            block_size=size,
            block_bytes=self.costs.block_bytes or 0,
            prefill_costs=prefill_costs,
            decode_costs=getattr(decode.load, "step_costs", None),
            bandwidth=self.costs.link_bandwidth(prefill.worker_id, decode.worker_id),
            prefill_chunk=self.prefill_chunk,
            decode_chunk=self.decode_chunk,
            prefill_cached_tokens=on_prefill,
            decode_cached_tokens=min(on_decode, (len(tokens) - 1) // size * size),
            prefill_queue_tokens=max(0, prefill.claimed_tokens - own_work),
            decode_queue_tokens=decode.local_prefill_tokens,
            decode_running=max(getattr(decode.load, "num_running", 0), decode.in_flight - 1),
            overhead_s=self.costs.overhead_s,
            streamed=self.streamed,
        )


def _blend(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - SMOOTHING) * average + SMOOTHING * sample
