"""`auto` (the default): `shm` between workers of one node, `collective` across nodes.

The sender serves both (one export registry, so a request is pinned once whichever
way it leaves). The receiver decides per ticket by comparing the node id in the
sender's endpoint with its own, and the result names the transport that actually
moved the bytes; there is no fallback: if the chosen transport fails, the fetch fails.
"""

from __future__ import annotations

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket
from kv_transfer.config import TransportOptions
from kv_transfer.integrity import BlockVerifier
from kv_transfer.node import node_id
from kv_transfer.push import FollowedSegments
from kv_transfer.receiver import TransportReceiver
from kv_transfer.sender import RegistrySender
from kv_transfer.transports.collective import CollectiveReceiver, CollectiveServer
from kv_transfer.transports.shm import ShmReceiver, ShmServer


def make_auto_sender(worker_id: str, pool: KVCachePool, options: TransportOptions):
    servers = [ShmServer, CollectiveServer] if pool.kv.device.type == "cpu" else [CollectiveServer]
    return RegistrySender("auto", worker_id, pool, options, servers)


class AutoReceiver(TransportReceiver):
    def __init__(self, worker_id: str, pool: KVCachePool, options: TransportOptions):
        super().__init__("auto", worker_id, pool, options)
        self.node = options.node_id or node_id()
        self.shm = ShmReceiver(worker_id, pool, options)
        self.collective = CollectiveReceiver(worker_id, pool, options)

    def choose(self, ticket: ExportTicket) -> TransportReceiver:
        """shm when the sender shares our node and serves shm, else collective."""
        endpoint = ticket.sender_endpoint
        same_node = endpoint.node == self.node
        if same_node and endpoint.shm is not None and self.pool.kv.device.type == "cpu":
            return self.shm
        return self.collective

    def _pull(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        deadline: float,
        verifier: BlockVerifier,
    ):
        return self.choose(ticket)._pull(ticket, dst_block_ids, deadline, verifier)

    def _follow(self, followed: FollowedSegments, timeout_s: float) -> str:
        return self.choose(followed.ticket)._follow(followed, timeout_s)

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        return self.choose(ticket).keepalive(ticket, timeout_s)

    def close(self) -> None:
        self.shm.close()
        self.collective.close()
