"""The one validated cluster configuration; YAML files and CLI flags fill the same fields.

`ClusterConfig.load(path, overrides)` reads YAML (unknown keys are an error, with the
list of valid ones), applies CLI overrides, and validates everything before any Ray
actor starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from engine.config import EngineConfig, ModelSettings
from worker.spec import TransferFailurePolicy, WorkerRole, WorkerSpec

Mode = Literal["disaggregated", "colocated"]
TransportName = Literal["auto", "shm", "collective", "grpc", "local"]
RouterPolicy = Literal["round_robin", "least_loaded", "power_of_two", "cache_aware"]
FirstTokenFrom = Literal["prefill", "decode"]
DisaggregationMode = Literal["always", "never", "auto"]

COLOCATED_CPU_STEP_TOKENS = 1024
"""Default step cap of a colocated CPU worker (`ClusterConfig.colocated_step_tokens`)."""
DECODE_SIDE_PREFILL_CPU_STEP_TOKENS = 256
"""Default step cap of a CPU decode worker under `disaggregation: auto`
(`ClusterConfig.decode_step_tokens`)."""
UNDRAWN_TOKEN = "drawn-at-cluster-start"
"""Stands in for an unset `cluster_token` when the transport options are validated
before the cluster draws the real one (it never reaches a worker)."""


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the field."""


@dataclass(frozen=True)
class ClusterConfig(ModelSettings):
    """Everything needed to start a pdserve cluster. The model and batching fields come
    from `ModelSettings` (engine/config.py) and are the same on every worker."""

    mode: Mode = "disaggregated"
    """`disaggregated` (prefill and decode pools) or `colocated` (one worker does both)."""
    prefill_workers: int = 1
    """Prefill workers (disaggregated mode)."""
    decode_workers: int = 1
    """Decode workers (in colocated mode: colocated workers, each prefilling and decoding)."""
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
    """GPUs per worker on GPU pools; 0 runs on CPU."""
    prefill_kv_blocks: int = 1024
    """KV blocks per prefill worker (holds prompts until their KV is exported and acked)."""
    decode_kv_blocks: int = 2048
    """KV blocks per decode (or colocated) worker: its admission capacity."""
    prefill_batch_tokens: int | None = None
    """Step budget of prefill workers (tokens), and on CPUs also the cap of a colocated
    worker's step. None: `max_batch_tokens` on GPUs; on CPUs `prefill_chunk_size` for a
    prefill worker (its prefill is compute-bound from a few hundred tokens on, so a
    bigger step only holds back every first token in it) and 1024 for a colocated one
    (fewer mixed steps stall the running streams: at 16 streams it traded TTFT, which
    vLLM leaves higher, for TPOT and throughput)."""
    decode_batch_tokens: int | None = None
    """Step budget of decode workers (tokens) in disaggregated mode. None:
    `max_batch_tokens`, except on CPUs under `disaggregation: auto`, where it is 256 (and
    the decode worker's prompt pieces no longer than that): a prompt the decode worker
    prefills itself rides in its decode steps and delays every stream in them, and a
    piece takes ~1.5 ms per token on one core. At 16 streams (1 + 1 workers on 2 cores,
    bf16) `auto` served 0.94x vLLM with an ITL p99 of 490 ms at 256, 0.96x with 789 ms
    at 512 (colocated: 792 ms); `always` served 0.72x."""
    transport: TransportName = "auto"
    """KV transport: `auto` (shm on one node, collective across nodes), shm, collective, grpc, local."""
    transport_options: dict = field(default_factory=dict)
    """Passed to the transport (chunk size, bandwidth cap, faults...)."""
    router_policy: RouterPolicy = "least_loaded"
    """How the router picks workers: round_robin, least_loaded, power_of_two, or cache_aware
    (the worker already holding most of the prompt's prefix, within a load bound)."""
    disaggregation: DisaggregationMode = "always"
    """Where prompts are prefilled in disaggregated mode: `always` on a prefill worker (KV
    moved), `never` on the decode worker, `auto` per request, whichever the measured costs
    predict sooner (prefill queue and time, KV transfer, interference with decoding)."""
    first_token_from: FirstTokenFrom = "prefill"
    """`prefill`: stream the first token as soon as prefill samples it; `decode`: after import."""
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
    transfer_timeout_s: float = 30.0
    """Bound on one KV fetch (connect, every wait, the whole transfer)."""
    lease_ttl_s: float = 30.0
    """Exported blocks are reclaimed this long after the last heartbeat without an ack."""
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
    cluster_token: str | None = None
    """Secret every worker-to-worker KV call carries; the cluster fills in a random one."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        _check_literals(self)
        if self.mode == "disaggregated" and self.prefill_workers < 1:
            raise ConfigError("prefill_workers must be >= 1 in disaggregated mode")
        if self.decode_workers < 1:
            raise ConfigError("decode_workers must be >= 1")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ConfigError("threads_per_worker must be >= 1")
        if self.decode_batch_tokens is not None and self.decode_batch_tokens < 1:
            raise ConfigError("decode_batch_tokens must be >= 1")
        if self.gpus_per_worker < 0:
            raise ConfigError("gpus_per_worker must be >= 0")
        if self.prestarted_workers and self.gpus_per_worker:
            raise ConfigError(
                "prestarted_workers would hold a GPU per process with no engine on it; "
                "on GPU pools use standby_workers (warm spares) instead"
            )
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
            "transfer_timeout_s",
            "lease_ttl_s",
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

    def _check_transport(self) -> None:
        """A transport that cannot connect two worker processes would make every request
        silently recompute on its decode worker: refuse it before anything starts."""
        from kv_transfer.registry import CROSS_PROCESS_TRANSPORTS

        if self.mode == "disaggregated" and self.transport not in CROSS_PROCESS_TRANSPORTS:
            raise ConfigError(
                f"transport {self.transport!r} moves KV only within one process, and prefill "
                f"and decode workers are separate processes; use one of "
                f"{sorted(CROSS_PROCESS_TRANSPORTS)}"
            )
        # Without a cluster_token here the cluster draws one before any worker starts
        # (`PDCluster`): validate the options as the workers will get them, with one.
        self.kv_transport_options(token=self.cluster_token or UNDRAWN_TOKEN)

    def check_pools(self, max_model_len: int) -> None:
        """Called by the cluster once the model's context is known: every pool must hold
        one sequence of `max_model_len` tokens, or some valid requests could never run."""
        needed = -(-max_model_len // self.block_size)
        roles = {"decode_kv_blocks": "decode"}
        if self.mode == "disaggregated":
            roles["prefill_kv_blocks"] = "prefill"
        for name, role in roles.items():
            engine = self.engine_config(role)
            if engine.usable_kv_blocks < needed:
                scratch = engine.scratch_blocks
                raise ConfigError(
                    f"{name}={engine.num_kv_blocks} cannot hold one {max_model_len}-token "
                    f"sequence ({needed} blocks of {self.block_size}"
                    + (f", plus {scratch} for the CUDA graphs' scratch" if scratch else "")
                    + f"); raise {name} to at least {needed + scratch} or lower max_model_len"
                )

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_worker > 0 else "cpu"

    def engine_config(self, role: Literal["prefill", "decode"]) -> EngineConfig:
        """The engine settings of one worker of `role` (colocated workers use `decode`)."""
        shared = {f.name: getattr(self, f.name) for f in fields(ModelSettings)}
        blocks = self.prefill_kv_blocks if role == "prefill" else self.decode_kv_blocks
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
            num_kv_blocks=blocks,
            num_threads=self.worker_threads,
        )

    @property
    def worker_threads(self) -> int:
        """`threads_per_worker`, or its default: the cores of this machine over the workers
        that serve at once (spares wait idle, so they do not count)."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        serving = self.decode_workers + (
            self.prefill_workers if self.mode == "disaggregated" else 0
        )
        return max(1, (os.cpu_count() or 1) // serving)

    @property
    def colocated_step_tokens(self) -> int:
        """The step cap of a colocated CPU worker. One engine runs both phases, so each
        step's prefill stalls every stream in it; but a wave of prompts spread over many
        half-size steps stalls them more often, for the same prefill work. At 16 streams
        (bf16, 256 in / 64 out) a cap of 512 served 1.03x vLLM with TPOT 1.15x and TTFT
        0.58x; 1024 served 1.16x, TPOT 0.90x, TTFT 0.79x."""
        if self.prefill_batch_tokens is not None:
            return self.prefill_batch_tokens
        return COLOCATED_CPU_STEP_TOKENS

    @property
    def decode_step_tokens(self) -> int:
        """The step cap of a decode worker (disaggregated mode): `decode_batch_tokens`, or
        its default (see there)."""
        if self.decode_batch_tokens is not None:
            return self.decode_batch_tokens
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
        if self.prefill_batch_tokens is not None:
            return self.prefill_batch_tokens
        return self.max_batch_tokens if self.device != "cpu" else self.prefill_chunk_size

    def kv_transport_options(self, token: str | None = None):
        """The validated `kv_transfer.TransportOptions` every prefill and decode worker
        gets (each worker fills in its own node's address where its servers bind every
        interface, see `WorkerSpec.transport_options_on`); `token` stands in for an
        unset `cluster_token` (validation before the cluster draws one)."""
        from kv_transfer.config import FaultOptions, TransportOptions

        settings = {
            "lease_ttl_s": self.lease_ttl_s,
            "timeout_s": self.transfer_timeout_s,
            "token": self.cluster_token or token or "",
        }
        settings.update(self.transport_options)
        if isinstance(settings.get("faults"), dict):
            settings["faults"] = FaultOptions(**settings["faults"])
        try:
            return TransportOptions(**settings)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"transport_options: {exc}") from exc

    def planned_workers(self) -> list[tuple[str, WorkerRole, bool]]:
        """(worker id, role, standby) of every worker the controller starts, prefill
        workers first; ids are `{role}-{index within role}`."""
        spares = self.standby_workers
        if self.mode == "colocated":
            roles: list[tuple[WorkerRole, int]] = [("colocated", self.decode_workers)]
        else:
            roles = [("prefill", self.prefill_workers), ("decode", self.decode_workers)]
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
            transport=self.transport,
            transport_options=None if role == "colocated" else self.kv_transport_options(),
            transfer_timeout_s=self.transfer_timeout_s,
            on_transfer_failure=self.on_transfer_failure,
        )

    def replace(self, **changes: Any) -> ClusterConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; valid keys: {sorted(valid)}")
        return cls(**data)

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
            data.update(loaded)
        data.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.from_dict(data)


def _check_literals(config: ClusterConfig) -> None:
    for name, hint in get_type_hints(type(config)).items():
        if get_origin(hint) is not Literal:
            continue
        allowed = get_args(hint)
        if getattr(config, name) not in allowed:
            raise ConfigError(
                f"{name} must be one of {list(allowed)}, got {getattr(config, name)!r}"
            )
