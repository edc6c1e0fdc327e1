"""The all-reduce of CPU ranks on one node, through a shared-memory segment.

A worker's ranks always share a node (STRICT_PACK), and on a CPU a step's all-reduces
are small: one row of the hidden size per decode sequence, two per layer. Over gloo's
loopback TCP each costs a few round trips and thread hand-offs (about 2 ms on a 2-core
VM, 60 of them per decode step of a 30-layer model); through shared memory it is a copy,
a flag and a sum. vLLM's CPU workers make the same trade.

Layout of the segment, made by rank 0 under /dev/shm and unlinked as soon as every rank
has mapped it (so no crash can leave it behind):

    [posted: size x int64, one cache line apart][pids: size x int64]
    [slots: 2 phases x size ranks x SLOT_BYTES]

Call g (counted from 1 on every rank) writes this rank's tensor into its slot of phase
g % 2, then posts g; once every rank has posted g, each sums the slots in rank order
(so every rank gets the same bits). A rank can post g + 2 (reusing phase g % 2) only
after every rank posted g + 1, which each does after it finished reading call g: two
phases are enough. Stores and loads keep their order on x86-64 (TSO), the only
architecture this is used on; elsewhere the group stays on gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from pathlib import Path

import torch

SLOT_BYTES = 256 * 1024
"""Largest tensor reduced here (64 rows of 1024 floats); larger ones (prefill chunks)
go to gloo, where the bytes, not the round trips, are the cost."""
LINE = 64
"""Bytes between two ranks' posted counters: one cache line each."""
SPINS_BEFORE_YIELD = 20
"""Polls before the waiting rank starts yielding its core: a rank that shares its core
(a test's threads, an oversubscribed machine) must let the peer it waits for run."""
LIVENESS_EVERY_S = 0.05
"""How often a waiting rank checks that its peers' processes are still alive."""
SHM_DIR = Path("/dev/shm")


class PeerGone(RuntimeError):
    """A peer rank's process died (or the group was aborted) while this rank waited."""


def shm_all_reduce_supported(device: str) -> bool:
    """Whether `TPGroup.join` may use it: CPU tensors, Linux's /dev/shm, x86-64 order."""
    return (
        torch.device(device).type == "cpu"
        and SHM_DIR.is_dir()
        and platform.machine() in ("x86_64", "AMD64")
    )


class ShmAllReduce:
    """One rank's handle on its group's segment. Built by `TPGroup.join` on every rank
    (a collective: rank 0 creates, the others map, then rank 0 unlinks); `all_reduce`
    is called by the model's row-parallel layers in the same order on every rank."""

    def __init__(self, rank: int, size: int, buffer: mmap.mmap, timeout_s: float):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._buffer = buffer
        header = size * LINE + size * 8
        words = torch.frombuffer(buffer, dtype=torch.int64, count=header // 8)
        self._posted = words[: size * LINE // 8 : LINE // 8]
        self._pids = words[size * LINE // 8 :]
        slots = torch.frombuffer(buffer, dtype=torch.uint8, offset=header)
        self._slots = slots.view(2, size, SLOT_BYTES)
        self._calls = 0
        self._aborted = False
        self._pids[rank] = os.getpid()

    @classmethod
    def join(cls, store, rank: int, size: int, barrier, timeout_s: float) -> ShmAllReduce:
        """Every rank calls this once; `store` carries the segment's name from rank 0,
        `barrier()` (a collective on the group's library) holds rank 0's unlink until
        every rank has mapped the segment."""
        nbytes = size * LINE + size * 8 + 2 * size * SLOT_BYTES
        if rank == 0:
            path = SHM_DIR / f"pdserve-tp-{os.getpid()}-{secrets.token_hex(8)}"
            with open(path, "w+b") as file:
                file.truncate(nbytes)
                buffer = mmap.mmap(file.fileno(), nbytes)
            store.set("shm_all_reduce", str(path))
        else:
            path = Path(store.get("shm_all_reduce").decode())
            with open(path, "r+b") as file:
                buffer = mmap.mmap(file.fileno(), nbytes)
        handle = cls(rank, size, buffer, timeout_s)
        barrier()
        if rank == 0:
            path.unlink()
        return handle

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.nbytes <= SLOT_BYTES

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (at most `SLOT_BYTES`) over the ranks, in place; returns it."""
        self._calls += 1
        call, phase = self._calls, self._calls % 2
        flat = tensor.reshape(-1)  # a view, or a copy when `tensor` is not contiguous
        nbytes = flat.nbytes
        self._slots[phase, self.rank, :nbytes].copy_(flat.view(torch.uint8))
        self._posted[self.rank] = call
        self._wait_for_all(call)
        parts = self._slots[phase, :, :nbytes].view(flat.dtype).view(self.size, -1)
        total = parts[0].clone()
        for rank in range(1, self.size):
            total += parts[rank]
        tensor.copy_(total.view_as(tensor))
        return tensor

    def abort(self) -> None:
        """Called when the worker fails as a unit: a rank waiting here raises `PeerGone`."""
        self._aborted = True

    def _wait_for_all(self, call: int) -> None:
        spins, started = 0, time.monotonic()
        checked = started
        while int(self._posted.min()) < call:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            time.sleep(0)  # yields the GIL and, in the kernel, the core
            now = time.monotonic()
            if now - checked >= LIVENESS_EVERY_S:
                checked = now
                self._check_peers(call, now - started)

    def _check_peers(self, call: int, waited_s: float) -> None:
        if self._aborted:
            raise PeerGone(f"tensor-parallel rank {self.rank}: the group was aborted")
        for rank in range(self.size):
            if int(self._posted[rank]) < call and not _alive(int(self._pids[rank])):
                raise PeerGone(
                    f"tensor-parallel rank {rank} (pid {int(self._pids[rank])}) died during "
                    f"all-reduce {call}"
                )
        if waited_s > self.timeout_s:
            raise PeerGone(
                f"tensor-parallel rank {self.rank}: all-reduce {call} waited {waited_s:.0f} s"
            )


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
