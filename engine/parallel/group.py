"""The process group of one worker's tensor-parallel ranks, passed in, never a global.

A worker of N ranks (rank 0 the worker's actor, the others its followers) builds one
`TPGroup` per rank at start, before its weights load: every rank calls `TPGroup.join`
with the same store (rank 0's, on loopback: the ranks share a node) and `size`. The
group is torch.distributed's gloo on CPU, NCCL on CUDA, made straight on the store like
the KV transport's pair groups (kv_transfer/transports/collective.py), so no
`init_process_group` world exists and two workers in one process (tests) never meet.

On a CPU the small all-reduces (a decode step's rows) go through a shared-memory
segment of the group's own instead (`ShmAllReduce`): over loopback TCP each cost
milliseconds of round trips, through memory microseconds.

What the model and the lockstep channel call on it: `all_reduce` (in place, the partial
sums of the row-parallel projections and of the vocab-parallel embedding),
`all_gather` (the LM head's vocabulary slices), `broadcast` (rank 0's step inputs) and
`all_min` (the ranks agreeing on a pool size). Every collective names its own timeout;
only the followers' wait for the next step has none worth speaking of (`IDLE_TIMEOUT`),
since a worker with no requests sends nothing for as long as it has none. A dead peer
fails every collective at once on gloo ("Connection closed by peer"); on NCCL the
watchdog's handling is set explicitly (`_nccl_failure_policy`) so that a dead peer
raises in the waiting thread instead of hanging it or tearing the process down.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.shm_all_reduce import ShmAllReduce, shm_all_reduce_supported

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0
"""A step's collectives (all ranks are inside the same step: only a dead or stuck peer
makes one wait this long)."""
IDLE_TIMEOUT = timedelta(days=365)
"""A follower waiting for rank 0's next step: as long as the worker is idle."""

NCCL_FAILURE_POLICY = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
"""A dead NCCL peer raises in the thread that waits (BLOCKING_WAIT), the watchdog aborts
only the communicator (ASYNC_ERROR_HANDLING=2; 3 would kill the process before the
worker could say why) and is not itself killed while it does (ENABLE_MONITORING=0). The
worker's health check then reports the rank's failure and the controller restarts the
whole group."""


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its worker's tensor-parallel group."""

    rank: int
    size: int
    group: object | None = field(default=None, compare=False)
    """The torch ProcessGroup; None when size is 1 (every call is then a no-op)."""
    device: str = "cpu"
    shm: ShmAllReduce | None = field(default=None, compare=False)
    """CPU ranks' all-reduce through shared memory, for the tensors it holds (a decode
    step's rows); None on CUDA, or where it cannot run (`shm_all_reduce_supported`)."""

    @classmethod
    def single(cls, device: str = "cpu") -> TPGroup:
        return cls(0, 1, None, device)

    @classmethod
    def join(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        device: str = "cpu",
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        host: str = "127.0.0.1",
    ) -> TPGroup:
        """Called once per rank at worker start, all ranks at about the same time (the
        call returns once all `size` have joined). `host`: the address gloo binds."""
        if size == 1:
            return cls.single(device)
        timeout = timedelta(seconds=timeout_s)
        if torch.device(device).type == "cuda":
            os.environ.update(NCCL_FAILURE_POLICY)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timeout
            group = dist.ProcessGroupGloo(store, rank, size, options)
        if not shm_all_reduce_supported(device):
            return cls(rank, size, group, device)
        shm = ShmAllReduce.join(
            dist.PrefixStore("shm-all-reduce", store),
            rank,
            size,
            barrier=lambda: group.allreduce([torch.zeros(1)]).wait(),
            timeout_s=timeout_s,
        )
        return cls(rank, size, group, device, shm)

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm.all_reduce(tensor)
        if self.group is not None:
            self.group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on each), concatenated along `dim`."""
        if self.group is None:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        if self.group is None:
            return tensor
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if timeout is not None:
            options.timeout = timeout
        self.group.broadcast([tensor], options).wait()
        return tensor

    def all_min(self, value: int) -> int:
        """The smallest of every rank's `value` (a pool's block count, say)."""
        if self.group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def abort(self) -> None:
        """Drop the group (a peer died): nothing pending on it can complete later."""
        if self.group is None:
            return
        if self.shm is not None:
            self.shm.abort()
        try:
            self.group.abort()
        except Exception:  # already broken
            logger.debug("aborting a TP group failed", exc_info=True)
