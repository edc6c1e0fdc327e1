"""The sender every transport shares: export registry, checksums, stats; transports add
the servers that move bytes.

Prefill worker lifecycle: `make_sender(...)` at start (servers bind, pool may move to
shared memory), `export()` once per prefilled request, `ack()` / `abort()` from the
cluster's messages, `poll_released()` every engine-loop iteration to free block ids,
`stats()` for metrics, `close()` at shutdown. Transport servers call `heartbeat()` and
the registry's `begin_transfer` / `end_transfer` from their own threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket, KVSender, StreamSegment
from kv_transfer.config import TransportOptions
from kv_transfer.control_messages import SegmentNote
from kv_transfer.device_checksum import checksum_algo_for
from kv_transfer.endpoints import SenderEndpoint, ServerEndpoint
from kv_transfer.integrity import block_checksums
from kv_transfer.node import node_id
from kv_transfer.ownership import ExportRegistry
from kv_transfer.push import pushed_segments
from kv_transfer.stats import SenderStats

logger = logging.getLogger(__name__)


class TransportServer(Protocol):
    """The serving half of one transport inside a sender."""

    def endpoint(self) -> ServerEndpoint: ...

    def close(self) -> None: ...


ServerFactory = Callable[["RegistrySender"], TransportServer]


class RegistrySender(KVSender):
    """A `KVSender` whose byte-moving servers come from `server_factories`."""

    def __init__(
        self,
        name: str,
        worker_id: str,
        pool: KVCachePool,
        options: TransportOptions,
        server_factories: list[ServerFactory],
    ):
        super().__init__(worker_id, pool)
        self.name = name
        self.options = options
        self.registry = ExportRegistry(worker_id, options.lease_ttl_s)
        self.servers = [make(self) for make in server_factories]

    def endpoint(self) -> SenderEndpoint:
        entries = [server.endpoint() for server in self.servers]
        return SenderEndpoint.serving(self.name, self.worker_id, self.node, entries)

    @property
    def node(self) -> str:
        return self.options.node_id or node_id()

    def export(
        self, request_id: str, block_ids: list[int], num_tokens: int, peer_id: str
    ) -> ExportTicket:
        if not block_ids or not all(0 <= b < self.pool.num_blocks for b in block_ids):
            raise ValueError(f"[request {request_id}] bad block ids {block_ids[:8]}")
        algo = checksum_algo_for(self.pool.kv.device, self.options.checksum)
        checksums = block_checksums(self.pool.kv, block_ids, algo)
        self.registry.add(request_id, block_ids, num_tokens, peer_id, checksums)
        return self._ticket(request_id, block_ids, num_tokens, checksums, algo)

    def export_segment(
        self,
        request_id: str,
        block_ids: list[int],
        first_block: int,
        num_tokens: int,
        peer_id: str,
        final: bool = False,
    ) -> ExportTicket:
        if not block_ids or not all(0 <= b < self.pool.num_blocks for b in block_ids):
            raise ValueError(f"[request {request_id}] bad block ids {block_ids[:8]}")
        algo = checksum_algo_for(self.pool.kv.device, self.options.checksum)
        checksums = block_checksums(self.pool.kv, block_ids, algo)
        self.registry.add_segment(
            request_id, block_ids, first_block, num_tokens, peer_id, checksums, final
        )
        segment = StreamSegment(first_block, final)
        return self._ticket(request_id, block_ids, num_tokens, checksums, algo, segment)

    def whole_ticket(self, request_id: str) -> ExportTicket:
        record = self.registry.get(request_id)
        if record is None:
            raise KeyError(f"[request {request_id}] no export")
        algo = checksum_algo_for(self.pool.kv.device, self.options.checksum)
        return self._ticket(request_id, record.block_ids, record.num_tokens, record.checksums, algo)

    def push_source(self) -> ExportTicket:
        algo = checksum_algo_for(self.pool.kv.device, self.options.checksum)
        return self._ticket("", [], 0, [], algo)

    def _ticket(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        checksums: list[int],
        algo: str,
        segment: StreamSegment | None = None,
    ) -> ExportTicket:
        return ExportTicket(
            request_id=request_id,
            sender_id=self.worker_id,
            sender_endpoint=self.endpoint(),
            layout=self.pool.layout,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            lease_ttl_s=self.options.lease_ttl_s,
            checksums=list(checksums),
            checksum_algo=algo,
            segment=segment,
        )

    def ack(self, request_id: str) -> None:
        if not self.registry.ack(request_id):
            logger.info("[request %s] late ack: blocks were already released", request_id)

    def abort(self, request_id: str) -> None:
        self.registry.abort(request_id)

    def poll_released(self) -> list[list[int]]:
        return self.registry.poll_released()

    def heartbeat(self, request_id: str) -> bool:
        return self.registry.heartbeat(request_id)

    def pushed(self, request_id: str, first_block: int) -> Iterator[SegmentNote | None]:
        """For a transport server serving a receiver's standing transfer (push): the
        export's runs of blocks from `first_block` on as they are exported, None while
        none comes (`kv_transfer.push.pushed_segments`; raises `ExportGone`). An export
        not there yet is waited for as long as the receiver waits: its prompt may be
        queued behind others, and a receiver that goes away breaks the transfer."""
        return pushed_segments(
            self.registry,
            request_id,
            first_block,
            appear_within_s=float("inf"),
            block_nbytes=self.pool.layout.block_nbytes,
        )

    def lease_beats(self, request_id: str) -> Callable[[], None]:
        """For a transport server streaming an export's pieces after `begin_transfer`
        (which extended its lease): call it after each piece; it extends the lease once
        every third of it, not per piece (the registry's lock, per MiB)."""
        every_s = self.options.lease_ttl_s / 3
        last = time.monotonic()

        def beat() -> None:
            nonlocal last
            if time.monotonic() - last >= every_s:
                self.heartbeat(request_id)
                last = time.monotonic()

        return beat

    def stats(self) -> SenderStats:
        return self.registry.stats()

    def leased_request_ids(self) -> list[str]:
        return self.registry.request_ids()

    def at_risk_request_ids(self) -> list[str]:
        if any(getattr(server, "exports_outlive_process", False) for server in self.servers):
            return []  # shm: the pool file outlives us, a same-node receiver still pulls
        return self.registry.unserved_request_ids()

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.registry.close()
