"""Transports by name: the only place a worker learns which transport classes exist.

Workers call `make_sender(name, worker_id, pool, options)` (prefill) or
`make_receiver(...)` (decode) once at start. Each transport module is imported only
when named, so a CPU machine never imports NCCL paths and `local` needs no network.
"""

from __future__ import annotations

import importlib

from engine.kv_cache import KVCachePool
from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.config import TransportOptions

# name -> (module, sender factory, receiver class)
TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "local": ("kv_transfer.transports.local", "make_local_sender", "LocalReceiver"),
    "shm": ("kv_transfer.transports.shm", "make_shm_sender", "ShmReceiver"),
    "collective": (
        "kv_transfer.transports.collective",
        "make_collective_sender",
        "CollectiveReceiver",
    ),
    "grpc": ("kv_transfer.transports.grpc", "make_grpc_sender", "GrpcReceiver"),
    "auto": ("kv_transfer.transports.auto", "make_auto_sender", "AutoReceiver"),
}

CROSS_PROCESS_TRANSPORTS = frozenset(TRANSPORTS) - {"local"}
"""Transports that connect a sender and a receiver in different processes; `local`
reaches only a sender in the receiver's own process."""

PUSH_TRANSPORTS = frozenset({"local", "shm", "grpc", "collective", "auto"})
"""Transports whose senders send a streamed export down a receiver's standing transfer
as its segments come (`KVReceiver.follow`, `kv_transfer_mode: push`)."""


def preload(name: str) -> None:
    """Import transport `name`'s module now (a prestarted worker process, ahead of the
    activation that will make its sender or receiver)."""
    _module(name)


def _module(name: str):
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    return importlib.import_module(TRANSPORTS[name][0])


def _lookup(name: str, index: int):
    return getattr(_module(name), TRANSPORTS[name][index])


def make_sender(
    name: str, worker_id: str, pool: KVCachePool, options: TransportOptions | None = None
) -> KVSender:
    """Prefill worker, once at start: the sender of transport `name` over `pool`."""
    return _lookup(name, 1)(worker_id, pool, options or TransportOptions())


def make_receiver(
    name: str, worker_id: str, pool: KVCachePool, options: TransportOptions | None = None
) -> KVReceiver:
    """Decode worker, once at start: the receiver of transport `name` into `pool`."""
    return _lookup(name, 2)(worker_id, pool, options or TransportOptions())
