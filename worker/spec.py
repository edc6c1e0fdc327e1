"""What the controller hands a worker at start: everything it needs, validated in the
driver before any actor starts, so workers never read the cluster's config.

The controller builds one `WorkerSpec` per worker from `ClusterConfig.worker_spec`;
the worker's constructor reads it once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.config import EngineConfig

if TYPE_CHECKING:
    from kv_transfer.config import TransportOptions

WorkerRole = Literal["prefill", "decode", "colocated"]
TransferFailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: WorkerRole
    engine: EngineConfig
    transport: str
    """KV transport name (`kv_transfer.registry`); unused by colocated workers."""
    transport_options: TransportOptions | None
    """Validated in the driver; None for colocated workers, which move no KV. Its
    `timeout_s` bounds a decode worker's fetch of one request's KV."""
    on_transfer_failure: TransferFailurePolicy
    """A failed import: `recompute` the prompt here, or `fail` the request."""
    cpu_cores: tuple[int, ...] | None = None
    """The cores this worker's threads run on (`cluster.control.core_plan`); None: any."""
    tp_size: int = 1
    """Tensor-parallel ranks: this actor is rank 0 and starts the others as
    `RankFollower` actors in the bundles of its placement group (worker/tp_ranks.py)."""
    rank_resources: dict[str, float] = field(default_factory=dict)
    """The custom resources each follower rank asks Ray for (its bundle's)."""
    rank_gpus: float = 0.0
    """GPUs each follower rank asks Ray for (its bundle's)."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"unknown worker role {self.role!r}")
        if self.role != "colocated" and self.transport_options is None:
            raise ValueError(f"a {self.role} worker needs transport options")
        if self.on_transfer_failure not in ("recompute", "fail"):
            raise ValueError(f"unknown on_transfer_failure {self.on_transfer_failure!r}")
        if self.cpu_cores is not None and (not self.cpu_cores or min(self.cpu_cores) < 0):
            raise ValueError(f"cpu_cores must name cores, not {self.cpu_cores!r}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, not {self.tp_size!r}")
        if self.tp_size > 1 and self.cpu_cores is not None:
            raise ValueError("a tensor-parallel worker's ranks are not pinned to cores")

    @property
    def device(self) -> str:
        return self.engine.device

    def transport_options_on(self, node_ip: str | None) -> TransportOptions:
        """The options as this worker's process uses them: a worker whose KV servers bind
        every interface advertises its own node's address to peers."""
        options = self.transport_options
        assert options is not None, "colocated workers have no transport"
        if options.bind_host in ("0.0.0.0", "::") and not options.advertise_host and node_ip:
            return dataclasses.replace(options, advertise_host=node_ip)
        return options
