"""The one validated cluster configuration; YAML files and CLI flags fill the same fields.

`ClusterConfig.load(path, overrides)` reads YAML (unknown keys are an error, with the
list of valid ones), applies CLI overrides, and validates everything before any Ray
actor starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from engine.config import EngineConfig

Mode = Literal["disaggregated", "colocated"]
TransportName = Literal["auto", "shm", "collective", "grpc", "local"]
RouterPolicy = Literal["round_robin", "least_loaded", "power_of_two"]
FirstTokenFrom = Literal["prefill", "decode"]
TransferFailurePolicy = Literal["recompute", "fail"]


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the field."""


@dataclass(frozen=True)
class ClusterConfig:
    """Everything needed to start a pdserve cluster."""

    model: str = "demo"
    """`demo` or a local HF model directory; the same on every worker."""
    dtype: str = "auto"
    """Weights/KV dtype: auto, float32, bfloat16, float16."""
    mode: Mode = "disaggregated"
    """`disaggregated` (prefill and decode pools) or `colocated` (one worker does both)."""
    prefill_workers: int = 1
    """Prefill workers (disaggregated mode)."""
    decode_workers: int = 1
    """In colocated mode, this many colocated workers."""
    threads_per_worker: int = 1
    """torch threads per worker on CPU (keep workers x threads <= cores)."""
    gpus_per_worker: float = 0.0
    """GPUs per worker on GPU pools; 0 runs on CPU."""
    block_size: int = 16
    """Tokens per KV block (the same on both pools: blocks move between them)."""
    prefill_kv_blocks: int = 1024
    """KV blocks per prefill worker (holds prompts until their KV is exported and acked)."""
    decode_kv_blocks: int = 2048
    """KV blocks per decode (or colocated) worker: its admission capacity."""
    max_num_seqs: int = 64
    """Most sequences in one engine step."""
    max_batch_tokens: int = 2048
    """Most tokens (prefill pieces + decode tokens) in one engine step."""
    prefill_chunk_size: int = 512
    """Longest piece of one prompt per step; longer prompts are chunked."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's context window."""
    transport: TransportName = "auto"
    """KV transport: `auto` (shm on one node, collective across nodes), shm, collective, grpc, local."""
    transport_options: dict = field(default_factory=dict)
    """Passed to the transport (chunk size, bandwidth cap, faults...)."""
    router_policy: RouterPolicy = "least_loaded"
    """How the router picks workers: round_robin, least_loaded, power_of_two."""
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
    """Times the controller restarts one worker after it dies (0 disables restarts)."""
    restart_backoff_s: float = 1.0
    """Wait before a restart; doubles with each failed attempt."""
    recovery_timeout_s: float = 30.0
    """How long a request waits for a live worker of a role before failing with 503."""
    cluster_token: str | None = None
    """Secret every worker-to-worker KV call carries; the cluster fills in a random one."""

    def __post_init__(self) -> None:
        _check_literals(self)
        if self.mode == "disaggregated" and self.prefill_workers < 1:
            raise ConfigError("prefill_workers must be >= 1 in disaggregated mode")
        if self.decode_workers < 1:
            raise ConfigError("decode_workers must be >= 1")
        if self.threads_per_worker < 1:
            raise ConfigError("threads_per_worker must be >= 1")
        if self.gpus_per_worker < 0:
            raise ConfigError("gpus_per_worker must be >= 0")
        if self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ConfigError("max_restarts and restart_backoff_s must be >= 0")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "request_timeout_s",
            "transfer_timeout_s",
            "lease_ttl_s",
            "recovery_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        try:
            self.engine_config("decode")
            self.engine_config("prefill")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_worker > 0 else "cpu"

    def engine_config(self, role: Literal["prefill", "decode"]) -> EngineConfig:
        """The engine settings of one worker of `role` (colocated workers use `decode`)."""
        blocks = self.prefill_kv_blocks if role == "prefill" else self.decode_kv_blocks
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            num_kv_blocks=blocks,
            max_num_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_batch_tokens,
            prefill_chunk_size=self.prefill_chunk_size,
            max_model_len=self.max_model_len,
            num_threads=self.threads_per_worker,
        )

    def kv_transport_options(self, node_ip: str | None = None):
        """`kv_transfer` options of one worker, built inside it. A worker whose KV servers
        bind every interface advertises its own node's address to peers."""
        from kv_transfer.config import FaultOptions, TransportOptions

        settings = {
            "lease_ttl_s": self.lease_ttl_s,
            "timeout_s": self.transfer_timeout_s,
            "token": self.cluster_token or "",
        }
        settings.update(self.transport_options)
        binds_all = settings.get("bind_host") in ("0.0.0.0", "::")
        if binds_all and not settings.get("advertise_host") and node_ip:
            settings["advertise_host"] = node_ip
        if isinstance(settings.get("faults"), dict):
            settings["faults"] = FaultOptions(**settings["faults"])
        return TransportOptions(**settings)

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
    hints = {
        "mode": Mode,
        "transport": TransportName,
        "router_policy": RouterPolicy,
        "first_token_from": FirstTokenFrom,
        "on_transfer_failure": TransferFailurePolicy,
    }
    for name, literal in hints.items():
        allowed = get_args(literal)
        if getattr(config, name) not in allowed:
            raise ConfigError(
                f"{name} must be one of {list(allowed)}, got {getattr(config, name)!r}"
            )
