"""The one validated cluster configuration; YAML files and CLI flags fill the same fields.

`ClusterConfig.load(path, overrides)` reads YAML (unknown keys are an error, with the
list of valid ones), applies CLI overrides, and validates everything before any Ray
actor starts. Besides its own keys the config has three sections, each a frozen
dataclass of its own and a nested mapping in YAML:

    prefill: {workers: 2, kv_blocks: 1024}      # PoolConfig: the prefill pool
    decode: {workers: 1, kv_blocks: auto, tp: 2}  # PoolConfig: the decode pool
    transport: {name: grpc, chunk_bytes: ...}   # TransportConfig: the KV transport

Each value has one owner: the transport's options (lease, timeouts, binds, TLS,
faults) are `kv_transfer.TransportOptions`' fields, declared there and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from cluster.config_flags import section_type
from engine.config import EngineConfig, ModelSettings
from kv_transfer.config import TransportOptions
from worker.messages import KVStream
from worker.spec import TransferFailurePolicy, WorkerRole, WorkerSpec

Mode = Literal["disaggregated", "colocated"]
TransportName = Literal["auto", "shm", "collective", "grpc", "local"]
RouterPolicy = Literal["round_robin", "least_loaded", "power_of_two", "cache_aware"]
FirstTokenFrom = Literal["prefill", "decode"]
KVStreaming = Literal["whole", "chunk"]
KVTransferMode = Literal["pull", "push"]
DisaggregationMode = Literal["always", "never", "auto"]

PoolName = Literal["prefill", "decode"]

POOL_RESOURCES = {"prefill": "prefill_pool", "decode": "decode_pool", "colocated": "decode_pool"}
"""Role -> the custom resource a node advertises per worker of that role it takes."""
CPU_POOL_KV_BLOCKS: dict[str, int] = {"prefill": 1024, "decode": 2048}
"""KV blocks per worker of a CPU pool given no count (`kv_blocks: auto`): CPU memory is
not profiled, so the pool keeps a fixed size (`ClusterConfig.kv_blocks`)."""
KV_BLOCKS_AUTO = "auto"
"""The `kv_blocks` value (YAML or flag) that means None: sized from the device."""
COLOCATED_CPU_STEP_TOKENS = 1024
"""Default step cap of a colocated CPU worker (`ClusterConfig.colocated_step_tokens`)."""
DECODE_SIDE_PREFILL_CPU_STEP_TOKENS = 256
"""Default step cap of a CPU decode worker under `disaggregation: auto`
(`ClusterConfig.decode_step_tokens`)."""
UNDRAWN_TOKEN = "drawn-at-cluster-start"
"""Stands in for an unset `transport.token` when the transport options are validated
before the cluster draws the real one (it never reaches a worker)."""
MOVED_KEYS = {
    "prefill_workers": "prefill.workers",
    "decode_workers": "decode.workers",
    "prefill_kv_blocks": "prefill.kv_blocks",
    "decode_kv_blocks": "decode.kv_blocks",
    "prefill_batch_tokens": "prefill.batch_tokens",
    "decode_batch_tokens": "decode.batch_tokens",
    "transport_options": "the transport section's own keys (transport.chunk_bytes, ...)",
    "lease_ttl_s": "transport.lease_ttl_s",
    "transfer_timeout_s": "transport.timeout_s",
    "cluster_token": "transport.token",
}
"""Keys of the flat config that became section keys: named in the error a file that
still uses one gets (they are not aliases; each value has one key)."""


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the field."""


def pool_of(role: str) -> PoolName:
    """The pool section of a worker role: colocated workers are the `decode` pool."""
    return "prefill" if role == "prefill" else "decode"


def kv_blocks_arg(text: str) -> int | str:
    """The value of `--prefill-kv-blocks` / `--decode-kv-blocks`: a block count or `auto`
    (left as the word: a flag's None means "not given")."""
    if text == KV_BLOCKS_AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a block count or {KV_BLOCKS_AUTO!r}, got {text!r}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """One role's worker pool: the `prefill` and `decode` sections."""

    workers: int = 1
    """Workers of this role to start (decode, in colocated mode: the colocated workers,
    each prefilling and decoding; prefill: at least 1 in disaggregated mode)."""
    kv_blocks: int | None = field(
        default=None, metadata={"type": kv_blocks_arg, "metavar": "N|auto"}
    )
    """KV blocks per worker: a prefill worker holds prompts in them until their KV is
    exported and acked; a decode (or colocated) worker's are its admission capacity.
    None (or `auto`): on GPU pools each worker sizes its pool from
    `gpu_memory_utilization` at start; on CPU pools `CPU_POOL_KV_BLOCKS` (prefill
    1024, decode 2048). A count overrides both."""
    batch_tokens: int | None = None
    """Step budget of each worker of the pool, in tokens (prefill: on CPUs also the cap
    of a colocated worker's step). None: a default per role and device (see
    `ClusterConfig.prefill_step_tokens`, `decode_step_tokens`, `colocated_step_tokens`)."""
    tp: int = 1
    """Tensor-parallel ranks per worker: each worker of the pool is this many processes
    on one node (a STRICT_PACK placement group; one GPU each on GPU pools), each holding
    its share of every layer's heads and of the MLP, and its heads' KV."""

    def __post_init__(self) -> None:
        if self.kv_blocks == KV_BLOCKS_AUTO:  # YAML's and the flag's word for None
            object.__setattr__(self, "kv_blocks", None)

    def check(self, section: str) -> None:
        """Called by `ClusterConfig.__post_init__`, which names the section."""
        values = {"workers": (self.workers, 0), "tp": (self.tp, 1)}
        for name in ("kv_blocks", "batch_tokens"):
            if getattr(self, name) is not None:
                values[name] = (getattr(self, name), 1)
        for name, (value, least) in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                allowed = " or 'auto'" if name == "kv_blocks" else ""
                raise ConfigError(
                    f"{section}.{name} must be an integer >= {least}{allowed}, got {value!r}"
                )


@dataclass(frozen=True)
class TransportConfig(TransportOptions):
    """The `transport` section: which KV transport moves blocks, and the options every
    prefill and decode worker builds it with. The options are `TransportOptions`' own
    fields (kv_transfer/config.py), declared there once; its `token` (the cluster token)
    may be unset here, and the cluster draws one at start. Workers get `options()`: a
    plain `TransportOptions`, with the token; this section itself never reaches a
    transport, since without the token it may hold a bind off loopback that
    `TransportOptions` alone would refuse."""

    name: TransportName = field(default="auto", metadata={"flag": "--transport"})
    """KV transport: `auto` (shm on one node, collective across nodes), shm, collective,
    grpc, local."""

    def __post_init__(self) -> None:
        # Validated as the workers will get it: with the token the cluster draws when
        # none is set (TransportOptions' own check would refuse an off-loopback bind).
        if self.name not in get_args(TransportName):
            raise ConfigError(
                f"transport.name must be one of {list(get_args(TransportName))}, got {self.name!r}"
            )
        self.options(token=UNDRAWN_TOKEN)

    def options(self, token: str | None = None) -> TransportOptions:
        """The options a worker builds its sender / receiver with; `token` stands in for
        an unset `token` (validation before the cluster draws one)."""
        values = {f.name: getattr(self, f.name) for f in fields(TransportOptions)}
        values["token"] = self.token or token or ""
        try:
            return TransportOptions(**values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"transport: {exc}") from exc


@dataclass(frozen=True)
class ClusterConfig(ModelSettings):
    """Everything needed to start a pdserve cluster. The model and batching fields come
    from `ModelSettings` (engine/config.py) and are the same on every worker."""

    mode: Mode = "disaggregated"
    """`disaggregated` (prefill and decode pools) or `colocated` (one worker does both)."""
    prefill: PoolConfig = PoolConfig()
    """The prefill pool (disaggregated mode)."""
    decode: PoolConfig = PoolConfig()
    """The decode pool; in colocated mode, the colocated workers."""
    threads_per_worker: int | None = None
    """torch threads per worker on CPU (keep workers x threads <= cores). None: this
    machine's cores shared evenly by the workers that serve at once (a colocated worker
    alone gets them all; 1 prefill + 1 decode worker on 2 cores get one each), at least
    1. Set it on a multi-node cluster, whose nodes may differ from the driver's."""
    pin_cores: bool = True
    """On a CPU cluster started here in disaggregated mode, give each worker its own
    cores and keep the frontend and Ray's own processes on the cores no worker has, or
    else on the decode workers', off the prefill workers', which set the pace under load
    (cluster/control/core_plan.py). On 2 cores at 16 streams it served 6-8% more; at one stream
    the decode worker shares its core and TPOT rose ~3 ms. Nothing
    is pinned on GPU pools, a joined Ray cluster, with warm spares, or with more worker
    threads than cores."""
    gpus_per_worker: float = 0.0
    """GPUs per worker on GPU pools; 0 runs on CPU. A worker of a pool with `tp` > 1
    takes one GPU per rank (`tp` GPUs), so it must be 1 there."""
    transport: TransportConfig = TransportConfig()
    """How KV moves from prefill to decode workers: the transport and its options."""
    router_policy: RouterPolicy = "least_loaded"
    """How the router picks workers: round_robin, least_loaded, power_of_two, or cache_aware
    (the worker already holding most of the prompt's prefix, within a load bound)."""
    disaggregation: DisaggregationMode = "always"
    """Where prompts are prefilled in disaggregated mode: `always` on a prefill worker (KV
    moved), `never` on the decode worker, `auto` per request, whichever the measured costs
    predict sooner (prefill queue and time, KV transfer, interference with decoding)."""
    first_token_from: FirstTokenFrom = "prefill"
    """`prefill`: stream the first token as soon as prefill samples it; `decode`: after import."""
    kv_streaming: KVStreaming = "whole"
    """When a prompt's KV leaves its prefill worker: `whole` after the last prefill chunk,
    `chunk` as each chunk's step ends (its completed blocks), so that the transfer of
    one chunk overlaps the compute of the next (docs/kv_transfer.md#streamed-exports)."""
    kv_transfer_mode: KVTransferMode = "pull"
    """`pull`: the decode worker asks for each export (each segment, streamed) once its
    ticket reaches it; `push`: the decode worker reserves its blocks and opens one
    transfer as the request arrives, and the prefill worker's sender sends each export
    (segment) down it as soon as it exists."""
    on_transfer_failure: TransferFailurePolicy = "recompute"
    """A failed KV import: `recompute` the prompt on the decode worker, or `fail` the request."""
    address: str | None = None
    """Ray address to join; None starts a local Ray cluster in-process."""
    namespace: str = "pdserve"
    """Ray namespace of the named worker actors."""
    health_interval_s: float = 1.0
    """Seconds between health probes of every worker."""
    health_timeout_s: float = 5.0
    """A health probe slower than this marks the worker dead."""
    request_timeout_s: float = 600.0
    """A request running longer is aborted and answered with 504."""
    max_restarts: int = 3
    """Restarts of one worker in a crash loop (each generation dying within
    `restart_budget_reset_s` of its start) before it stays dead; 0 disables restarts."""
    restart_backoff_s: float = 1.0
    """Wait before a second restart attempt; doubles with each failed attempt (the first
    attempt starts at once)."""
    restart_budget_reset_s: float = 20.0
    """A worker healthy this long after a (re)start was not crash-looping: its
    `max_restarts` budget comes back (at the next health call, or when it dies). Crash
    loops die within seconds of a start; a worker killed after serving for a while is
    restarted however often that happens."""
    standby_workers: int = 0
    """Warm spares per role: started and ready but not routed to; one takes a dead
    worker's place at once, and the dead one comes back as the new spare."""
    standby_restart_delay_s: float = 5.0
    """When a spare took a dead worker's place, its restart (which only rebuilds the
    spare) starts this much later, and so does the replacement of a prestarted process
    a restart took: a process's start keeps a core busy for seconds, which on a small
    node is taken from the requests recovering on the survivors."""
    prestarted_workers: int = 0
    """Worker processes per role started ahead, imports done but nothing built (no
    weights, no KV pool): a restart takes one and only builds the engine in it (~0.2 s
    for the demo model, against 3-4 s for a new process on 2 cores). CPU pools only."""
    recovery_timeout_s: float = 30.0
    """How long a request waits for a live worker of a role before failing with 503."""

    def __post_init__(self) -> None:
        _check_sections(self)
        try:
            super().__post_init__()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        _check_literals(self)
        self.prefill.check("prefill")
        self.decode.check("decode")
        if self.mode == "disaggregated" and self.prefill.workers < 1:
            raise ConfigError("prefill.workers must be >= 1 in disaggregated mode")
        if self.decode.workers < 1:
            raise ConfigError("decode.workers must be >= 1")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ConfigError("threads_per_worker must be >= 1")
        if self.gpus_per_worker < 0:
            raise ConfigError("gpus_per_worker must be >= 0")
        if self.prestarted_workers and self.gpus_per_worker:
            raise ConfigError(
                "prestarted_workers would hold a GPU per process with no engine on it; "
                "on GPU pools use standby_workers (warm spares) instead"
            )
        self._check_tp()
        self._check_gpu_share()
        restarts = (
            "max_restarts",
            "restart_backoff_s",
            "standby_workers",
            "standby_restart_delay_s",
            "prestarted_workers",
        )
        if any(getattr(self, name) < 0 for name in restarts):
            raise ConfigError(f"{', '.join(restarts)} must be >= 0")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "request_timeout_s",
            "recovery_timeout_s",
            "restart_budget_reset_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        self._check_transport()
        try:
            self.engine_config("decode")
            self.engine_config("prefill")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def _check_tp(self) -> None:
        split = {name: self.pool(name).tp for name in self.roles_in_use if self.pool(name).tp > 1}
        if not split:
            return
        pools = ", ".join(f"{name}.tp={tp}" for name, tp in split.items())
        if self.gpus_per_worker and self.gpus_per_worker != 1:
            raise ConfigError(
                f"{pools}: a tensor-parallel worker takes one whole GPU per rank; "
                f"gpus_per_worker={self.gpus_per_worker} would share or split them (set it to 1)"
            )
        if self.prestarted_workers:
            raise ConfigError(
                f"{pools}: prestarted_workers start one process per worker, not a group of "
                "ranks; use standby_workers (warm spares) for tensor-parallel pools"
            )

    def _check_gpu_share(self) -> None:
        """Workers that share a GPU (`gpus_per_worker` < 1) and size their KV pools from
        it would each take `gpu_memory_utilization` of the whole device, and the later
        ones to start would find it taken: refused before anything starts."""
        share = self.gpus_per_worker
        sized = [role for role in self.roles_in_use if self.kv_blocks(role) is None]
        if not sized or not 0 < share < 1 or self.gpu_memory_utilization <= share:
            return
        pools = " and ".join(f"{role}.kv_blocks" for role in sized)
        raise ConfigError(
            f"gpus_per_worker={share:g} shares each GPU between workers, and with {pools} "
            f"unset each sizes its KV pool from gpu_memory_utilization="
            f"{self.gpu_memory_utilization:g} of the whole GPU; set gpu_memory_utilization "
            f"to at most {share:g} (each worker's share) or set {pools}"
        )

    @property
    def roles_in_use(self) -> tuple[str, ...]:
        """The pool sections this mode starts workers of."""
        return ("prefill", "decode") if self.mode == "disaggregated" else ("decode",)

    def check_tp(self, spec) -> None:
        """Called by the cluster once the model is known (its `ModelSpec`), before any
        process starts: every pool's `tp` must split the model's heads, and KV moves
        between the pools' splits head slice by head slice. A split that cannot work
        is refused naming both pools, never found out by a hang or a wrong answer."""
        from engine.parallel.shard import ModelShard, TPSplitError

        sides = {name: self.pool(name).tp for name in self.roles_in_use}
        named = " and ".join(f"{name}.tp={tp}" for name, tp in sides.items())
        for name, tp in sides.items():
            try:
                ModelShard.of(spec, tp, 0)
            except TPSplitError as exc:
                raise ConfigError(
                    f"{name}.tp={tp} cannot serve {spec.model_id} ({spec.num_heads} attention "
                    f"heads, {spec.num_kv_heads} KV heads, intermediate "
                    f"{spec.intermediate_size}) with {named}: {exc.message}"
                ) from None

    def _check_transport(self) -> None:
        """A transport that cannot connect two worker processes would make every request
        silently recompute on its decode worker: refuse it before anything starts."""
        from kv_transfer.registry import CROSS_PROCESS_TRANSPORTS

        name = self.transport.name
        if self.mode == "disaggregated" and name not in CROSS_PROCESS_TRANSPORTS:
            raise ConfigError(
                f"transport {name!r} moves KV only within one process, and prefill "
                f"and decode workers are separate processes; use one of "
                f"{sorted(CROSS_PROCESS_TRANSPORTS)}"
            )
        self._check_streaming()

    def _check_streaming(self) -> None:
        """Streaming or push where nothing can stream is refused, never quietly turned
        into whole-prompt pulls."""
        from kv_transfer.registry import PUSH_TRANSPORTS

        if self.kv_stream == KVStream.WHOLE:
            return
        wanted = f"kv_streaming: {self.kv_streaming}, kv_transfer_mode: {self.kv_transfer_mode}"
        if self.mode != "disaggregated":
            raise ConfigError(f"{wanted} needs mode: disaggregated (colocated workers move no KV)")
        if self.disaggregation == "never":
            raise ConfigError(f"{wanted} with disaggregation: never: no KV ever moves")
        if self.prefill.tp > 1 or self.decode.tp > 1:
            raise ConfigError(
                f"{wanted} with prefill.tp={self.prefill.tp}, decode.tp={self.decode.tp}: "
                "streamed and pushed KV move one rank's pool; tensor-parallel workers move "
                "whole prompts (kv_streaming: whole, kv_transfer_mode: pull)"
            )
        name = self.transport.name
        if self.kv_stream == KVStream.PUSH and name not in PUSH_TRANSPORTS:
            raise ConfigError(
                f"kv_transfer_mode: push over transport {name!r}: only "
                f"{sorted(PUSH_TRANSPORTS)} can push (docs/kv_transfer.md#push)"
            )

    @property
    def kv_stream(self) -> KVStream:
        """How a disaggregated request's KV moves (`worker.messages.KVStream`): whole and
        pulled (`whole` + `pull`), segments pulled (`chunk` + `pull`), or pushed (`push`,
        per chunk with `chunk`)."""
        if self.kv_transfer_mode == "push":
            return KVStream.PUSH
        return KVStream.PULL if self.kv_streaming == "chunk" else KVStream.WHOLE

    def check_pools(self, max_model_len: int) -> None:
        """Called by the cluster once the model's context is known, before any worker
        starts: every pool of fixed blocks must hold one sequence of `max_model_len`
        tokens, or some valid requests could never run. A pool its workers size from the
        device is checked after start, on what they report (`check_reported_pool`)."""
        needed = self.blocks_per_sequence(max_model_len)
        for role in self.roles_in_use:
            engine = self.engine_config(role)
            if engine.usable_kv_blocks is None or engine.usable_kv_blocks >= needed:
                continue
            name, scratch = f"{role}.kv_blocks", engine.scratch_blocks
            raise ConfigError(
                f"{name}={engine.num_kv_blocks} cannot hold one {max_model_len}-token "
                f"sequence ({needed} blocks of {self.block_size}"
                + (f", plus {scratch} for the CUDA graphs' scratch" if scratch else "")
                + f"); raise {name} to at least {needed + scratch} or lower max_model_len"
            )

    def check_reported_pool(self, role: PoolName, usable_blocks: int, max_model_len: int) -> None:
        """Called by the cluster after start for a pool its workers sized from the device
        (`kv_blocks(role)` is None), with the fewest blocks one of them can hand out: the
        same refusal as `check_pools`, on the measured size."""
        needed = self.blocks_per_sequence(max_model_len)
        if usable_blocks >= needed:
            return
        raise ConfigError(
            f"the {role} pool's workers sized their KV pools from gpu_memory_utilization "
            f"{self.gpu_memory_utilization:g} to {usable_blocks} usable blocks, which cannot "
            f"hold one {max_model_len}-token sequence ({needed} blocks of {self.block_size}); "
            f"raise gpu_memory_utilization, lower max_model_len, or set {role}.kv_blocks"
        )

    def blocks_per_sequence(self, max_model_len: int) -> int:
        """KV blocks one sequence of `max_model_len` tokens takes."""
        return -(-max_model_len // self.block_size)

    def kv_blocks(self, role: str) -> int | None:
        """KV blocks per worker of `role`'s pool: its `kv_blocks`, else on CPU pools
        `CPU_POOL_KV_BLOCKS`; None where each worker sizes its pool from
        `gpu_memory_utilization` at start (the controller's `kv_capacity` then has it)."""
        pool = pool_of(role)
        blocks = self.pool(pool).kv_blocks
        if blocks is None and self.device == "cpu":
            return CPU_POOL_KV_BLOCKS[pool]
        return blocks

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_worker > 0 else "cpu"

    def gpus_per_rank(self, role: str) -> float:
        """GPUs each process of a worker of `role` asks Ray for: `gpus_per_worker` on a
        pool of one rank per worker, one per rank on a tensor-parallel pool."""
        if not self.gpus_per_worker:
            return 0.0
        return 1.0 if self.tp_of(role) > 1 else self.gpus_per_worker

    def tp_of(self, role: str) -> int:
        """Ranks of a worker of `role` (colocated workers are the `decode` pool)."""
        return self.pool(pool_of(role)).tp

    def pool(self, role: PoolName) -> PoolConfig:
        """The section of `role` (colocated workers are the `decode` pool)."""
        return self.prefill if role == "prefill" else self.decode

    def engine_config(self, role: PoolName) -> EngineConfig:
        """The engine settings of one worker of `role` (colocated workers use `decode`)."""
        shared = {f.name: getattr(self, f.name) for f in fields(ModelSettings)}
        if role == "prefill":
            shared["max_batch_tokens"] = self.prefill_step_tokens
        elif self.mode == "colocated" and self.device == "cpu":
            shared["max_batch_tokens"] = min(self.max_batch_tokens, self.colocated_step_tokens)
        elif self.mode == "disaggregated":
            shared["max_batch_tokens"] = self.decode_step_tokens
            shared["prefill_chunk_size"] = self.decode_prefill_chunk
        return EngineConfig(
            **shared,
            device=self.device,
            num_kv_blocks=self.kv_blocks(role),
            num_threads=self.worker_threads,
        )

    @property
    def worker_threads(self) -> int:
        """`threads_per_worker`, or its default: the cores of this machine over the workers
        that serve at once (spares wait idle, so they do not count)."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        serving = sum(self.pool(name).workers * self.pool(name).tp for name in self.roles_in_use)
        return max(1, (os.cpu_count() or 1) // serving)

    @property
    def colocated_step_tokens(self) -> int:
        """The step cap of a colocated CPU worker. One engine runs both phases, so each
        step's prefill stalls every stream in it; but a wave of prompts spread over many
        half-size steps stalls them more often, for the same prefill work. At 16 streams
        (bf16, 256 in / 64 out) a cap of 512 served 1.03x vLLM with TPOT 1.15x and TTFT
        0.58x; 1024 served 1.16x, TPOT 0.90x, TTFT 0.79x."""
        if self.prefill.batch_tokens is not None:
            return self.prefill.batch_tokens
        return COLOCATED_CPU_STEP_TOKENS

    @property
    def decode_step_tokens(self) -> int:
        """The step cap of a decode worker (disaggregated mode): `decode.batch_tokens`, or
        by default `max_batch_tokens`, except on CPUs under `disaggregation: auto`, where
        it is 256 (and the decode worker's prompt pieces no longer than that): a prompt
        the decode worker prefills itself rides in its decode steps and delays every
        stream in them, and a piece takes ~1.5 ms per token on one core. At 16 streams
        (1 + 1 workers on 2 cores, bf16) `auto` served 0.94x vLLM with an ITL p99 of
        490 ms at 256, 0.96x with 789 ms at 512 (colocated: 792 ms); `always` served
        0.72x."""
        if self.decode.batch_tokens is not None:
            return self.decode.batch_tokens
        if self.device == "cpu" and self.disaggregation == "auto":
            return min(self.max_batch_tokens, DECODE_SIDE_PREFILL_CPU_STEP_TOKENS)
        return self.max_batch_tokens

    @property
    def decode_prefill_chunk(self) -> int:
        """The longest prompt piece a decode worker prefills in one step (disaggregated
        mode): what `auto` prices a local prefill at."""
        return min(self.prefill_chunk_size, self.decode_step_tokens)

    @property
    def prefill_step_tokens(self) -> int:
        """The step cap of a prefill worker: `prefill.batch_tokens`, or by default
        `max_batch_tokens` on GPUs and `prefill_chunk_size` on CPUs (a CPU's prefill is
        compute-bound from a few hundred tokens on, so a bigger step only holds back
        every first token in it)."""
        if self.prefill.batch_tokens is not None:
            return self.prefill.batch_tokens
        return self.max_batch_tokens if self.device != "cpu" else self.prefill_chunk_size

    def kv_transport_options(self, token: str | None = None) -> TransportOptions:
        """The validated `kv_transfer.TransportOptions` every prefill and decode worker
        gets (each worker fills in its own node's address where its servers bind every
        interface, see `WorkerSpec.transport_options_on`); `token` stands in for an
        unset `transport.token` (validation before the cluster draws one)."""
        return self.transport.options(token)

    def planned_workers(self) -> list[tuple[str, WorkerRole, bool]]:
        """(worker id, role, standby) of every worker the controller starts, prefill
        workers first; ids are `{role}-{index within role}`."""
        spares = self.standby_workers
        if self.mode == "colocated":
            roles: list[tuple[WorkerRole, int]] = [("colocated", self.decode.workers)]
        else:
            roles = [("prefill", self.prefill.workers), ("decode", self.decode.workers)]
        return [
            (f"{role}-{i}", role, i >= active)
            for role, active in roles
            for i in range(active + spares)
        ]

    def worker_spec(
        self, worker_id: str, role: WorkerRole, cpu_cores: tuple[int, ...] | None = None
    ) -> WorkerSpec:
        """What the controller hands the worker `worker_id` at start (`cpu_cores`: its
        cores in the controller's `CorePlan`, if it made one)."""
        return WorkerSpec(
            worker_id=worker_id,
            role=role,
            cpu_cores=cpu_cores,
            engine=self.engine_config("prefill" if role == "prefill" else "decode"),
            transport=self.transport.name,
            transport_options=None if role == "colocated" else self.kv_transport_options(),
            on_transfer_failure=self.on_transfer_failure,
            tp_size=self.tp_of(role),
            rank_resources=self.rank_resources(role),
            rank_gpus=self.gpus_per_rank(role),
        )

    def rank_resources(self, role: str) -> dict[str, float]:
        """The custom resources each rank of a worker of `role` asks Ray for: a worker
        takes one unit of its pool's resource (`POOL_RESOURCES`) whatever its `tp`, its
        ranks a 1/tp share each, so a node that advertises one unit per worker takes one
        tensor-parallel worker as it takes one of a single rank."""
        return {POOL_RESOURCES[role]: round(1.0 / self.tp_of(role), 4)}

    def replace(self, **changes: Any) -> ClusterConfig:
        """A copy with `changes`; a section's change may be a mapping of some of its keys,
        laid over the section as it is here (`replace(decode={"workers": 2})`)."""
        return _laid_over(self, changes, "")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """A config from a YAML file's nesting: each section's keys are laid over that
        section's defaults (`{"decode": {"workers": 2}}` keeps the decode pool's blocks)."""
        return _laid_over(cls(), data, "")

    @classmethod
    def load(
        cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None
    ) -> ClusterConfig:
        """YAML file (optional) with CLI overrides on top; overrides of None are ignored."""
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path} must hold a mapping of config keys")
            data = loaded
        return cls.from_dict(_overlaid(data, overrides or {}))


def _overlaid(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with `overrides` on top, section by section; overrides of None are ignored."""
    merged = dict(data)
    for key, value in overrides.items():
        if value is None:
            continue
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            value = _overlaid(merged[key], value)
        merged[key] = value
    return merged


def _laid_over(base, changes: Mapping[str, Any], where: str):
    """`base` (a config or one of its sections) with `changes`, nested mappings laid over
    the sections they name; unknown keys are an error listing the valid ones."""
    cls = type(base)
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(changes) - set(valid))
    if unknown:
        raise ConfigError(_unknown_keys(where, unknown, valid))
    values = {}
    for name, value in changes.items():
        if section_type(cls, name) is not None and isinstance(value, Mapping):
            value = _laid_over(getattr(base, name), value, f"{where}{name}.")
        values[name] = value
    try:
        return dataclasses.replace(base, **values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where.rstrip('.') or 'config'}: {exc}") from exc


def _unknown_keys(where: str, unknown: list[str], valid: list[str]) -> str:
    place = f"keys in {where.rstrip('.')}" if where else "config keys"
    message = f"unknown {place} {unknown}; valid keys: {sorted(valid)}"
    moved = [
        f"{key} is now {MOVED_KEYS[key]}" for key in unknown if not where and key in MOVED_KEYS
    ]
    return f"{message} ({'; '.join(moved)})" if moved else message


def _check_sections(config: ClusterConfig) -> None:
    """A section given as anything but its dataclass (a YAML mapping goes through
    `from_dict`, which builds it) is refused before anything reads it."""
    for f in fields(config):
        section = section_type(type(config), f.name)
        value = getattr(config, f.name)
        if section is not None and not isinstance(value, section):
            hint = (
                f" (now {{name: {value}}})"
                if f.name == "transport" and isinstance(value, str)
                else ""
            )
            raise ConfigError(
                f"{f.name} is a section: a mapping of its keys{hint}, got {value!r}; "
                f"valid keys: {sorted(x.name for x in fields(section))}"
            )


def _check_literals(config: ClusterConfig) -> None:
    for name, hint in get_type_hints(type(config)).items():
        if get_origin(hint) is not Literal:
            continue
        allowed = get_args(hint)
        if getattr(config, name) not in allowed:
            raise ConfigError(
                f"{name} must be one of {list(allowed)}, got {getattr(config, name)!r}"
            )
