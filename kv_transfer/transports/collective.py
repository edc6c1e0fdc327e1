"""`collective`: torch.distributed point-to-point over a process group per (sender, receiver).

There is no world: each pair gets its own two-rank group (gloo for CPU pools, NCCL for
CUDA pools, same code), rendezvoused through the sender's `TCPStore` under a
`PrefixStore` unique to that pair, so a worker joining or dying touches only its own
pairs. Lifecycle of a pair and of one transfer:

    receiver                                   sender (control thread of this pair)
    open control connection, Pair           -> Reply(prefix); build group rank 0
    build group rank 1 (rendezvous via store)
    Fetch(request_id, dst ids)              -> begin_transfer; Reply(piece_bytes)
    with it, a recv per piece into our pool <- send each piece from the pool (no copy),
      (the piece size is in the sender's       pacing, faults, lease heartbeats
      endpoint: no round trip before data)
    wait for Done                           <- end_transfer; Done(nbytes)
    ... later fetches reuse the pair ...
    any failure: both ends drop the pair (group aborted, connection closed); the next
    fetch builds a fresh one. The connection closing is how a sender sees a dead peer.

Device pools: both ends issue their NCCL sends and receives with their
`TransferStream` current (kv_transfer/transfer_stream.py), so NCCL's kernels wait for
nothing on the engine's compute stream and no compute kernel waits for them. A dead
peer must fail the transfer and leave the surviving worker serving: before any NCCL
pair group is made, `nccl_failure_policy` sets (for this process, whatever was set
before) TORCH_NCCL_BLOCKING_WAIT=1, so `work.wait(timeout)` blocks the transfer's own
thread and raises there when the peer stops answering (the fetch fails with TIMEOUT or
PEER_DIED, the pair is dropped); TORCH_NCCL_ASYNC_ERROR_HANDLING=2, so torch's watchdog,
seeing that timed-out work, aborts the pair's communicator only (its default, 3, tears
the whole process down); and TORCH_NCCL_ENABLE_MONITORING=0, so a watchdog stuck in
that abort is not taken for a hung process and killed with it. The cost: a worker
whose engine hangs is not killed by NCCL either; the controller's health checks are
what find it.

What is protected: the control connection carries the cluster token and speaks TLS
when `tls_certfile` is set. What is not: the store listens on `bind_host` in plaintext
and checks no token (whoever reaches it can read and overwrite the pairs' rendezvous
keys, i.e. spoil or redirect a pair's set-up), and gloo/NCCL move the KV bytes in
plaintext between the addresses the pair's devices bind (`dial_host` on each side).
Checksums from the ticket (which travels over Ray, not this wire) catch altered bytes,
not read ones: keep these ports inside the cluster's network.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket, FailureReason, KVTransferError
from kv_transfer.blockio import Piece, flat_bytes, plan_pieces, requested_blocks, total_bytes
from kv_transfer.config import TransportOptions
from kv_transfer.control import (
    ChannelClosed,
    ControlConnection,
    ControlServer,
    recv_message,
    responsive,
    send_message,
)
from kv_transfer.control_messages import (
    WAITING,
    Done,
    Fetch,
    Follow,
    Heartbeat,
    Pair,
    Reply,
    SegmentNote,
    parse_request,
)
from kv_transfer.endpoints import CollectiveEndpoint, HostPort
from kv_transfer.faults import DropTransfer, FaultPlan
from kv_transfer.integrity import BlockVerifier
from kv_transfer.listeners import bind_listener
from kv_transfer.push import ExportGone, FollowedSegments
from kv_transfer.receiver import TransportReceiver, fail, remaining
from kv_transfer.sender import RegistrySender
from kv_transfer.shaping import Shaper
from kv_transfer.transfer_stream import TransferStream

logger = logging.getLogger(__name__)

SENDER_RANK, RECEIVER_RANK = 0, 1


NCCL_FAILURE_POLICY = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
"""How a dead NCCL peer is handled (module docstring): read by torch when a
ProcessGroupNCCL is made, so set before every pair group is."""


def nccl_failure_policy() -> dict[str, str]:
    """Set `NCCL_FAILURE_POLICY` in this process's environment (returns what it set);
    called by `make_pair_group` before it makes an NCCL group."""
    changed = {k: v for k, v in NCCL_FAILURE_POLICY.items() if os.environ.get(k) != v}
    if changed:
        logger.info("NCCL pair groups: setting %s", changed)
        os.environ.update(changed)
    return dict(NCCL_FAILURE_POLICY)


def make_pair_group(
    store: dist.Store, prefix: str, rank: int, host: str, device: torch.device, timeout_s: float
):
    """Two-rank group on `device`'s backend; both ends call this at the same time."""
    pair_store = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        nccl_failure_policy()
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(pair_store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(pair_store, rank, 2, options)


def listening_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The sender's rendezvous store, listening on `host` only. Given a host name alone,
    torch's store listens on every interface; here it gets a socket already bound to
    `host` (and owns it from then on: the store closes it)."""
    listener = bind_listener(host)
    try:
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store


def drop_group(group) -> None:
    """Abort a pair's group so nothing pending on it can ever match a later transfer."""
    try:
        group.abort()
    except Exception:  # already broken: nothing left to release
        logger.debug("aborting a KV pair group failed", exc_info=True)


class CollectiveServer:
    """Sender half: the rendezvous store and one control thread per receiver pair."""

    def __init__(self, sender: RegistrySender):
        self.sender = sender
        self.options = sender.options
        self.store = listening_store(self.options.bind_host, self.options.timeout_s)
        self.control = ControlServer(self.options, self._serve_pair, "kv-collective")
        self.piece_bytes = self._shaper().piece_bytes(self.options.chunk_bytes)
        """Fixed by the options; in the endpoint, so receivers post receives with a fetch."""
        self.stream = TransferStream(sender.pool.kv.device)
        """Device pools: the sends are issued here, off the engine's compute stream."""

    def _shaper(self) -> Shaper:
        return Shaper(self.options.bandwidth_bytes_per_s, self.options.added_latency_s)

    def endpoint(self) -> CollectiveEndpoint:
        host = self.options.dial_host
        return CollectiveEndpoint(
            control=HostPort(host, self.control.port),
            store=HostPort(host, self.store.port),
            piece_bytes=self.piece_bytes,
        )

    def _serve_pair(self, conn: socket.socket, message: dict) -> None:
        pair = parse_request(message)
        if not isinstance(pair, Pair):
            _reply(conn, Reply(False, FailureReason.INTERNAL, "pair first"))
            return
        prefix = f"kv/{self.sender.worker_id}/{pair.receiver}/{uuid.uuid4().hex}"
        _reply(conn, Reply(True, prefix=prefix))
        group = make_pair_group(
            self.store,
            prefix,
            SENDER_RANK,
            self.options.dial_host,
            self.sender.pool.kv.device,
            self.options.timeout_s,
        )
        try:
            while True:
                request = parse_request(recv_message(conn))
                if isinstance(request, Heartbeat):
                    alive = self.sender.heartbeat(request.request_id)
                    _reply(conn, Reply(alive, FailureReason.UNKNOWN_REQUEST))
                elif isinstance(request, Fetch):
                    self._serve_fetch(conn, group, request)
                elif isinstance(request, Follow):
                    self._serve_follow(conn, group, request)
                else:
                    _reply(conn, Reply(False, FailureReason.INTERNAL))
        finally:
            drop_group(group)

    def _serve_fetch(self, conn: socket.socket, group, request: Fetch) -> None:
        request_id = request.request_id
        record = self.sender.registry.begin_transfer(request_id)
        if record is None:
            _reply(conn, Reply(False, FailureReason.UNKNOWN_REQUEST))
            return
        shaper, piece_bytes = self._shaper(), self.piece_bytes
        block_nbytes = self.sender.pool.layout.block_nbytes
        dst = request.dst_block_ids
        src = requested_blocks(record.block_ids, len(dst), request.first_block)
        if src is None:
            self.sender.registry.end_transfer(request_id, 0, FailureReason.INTERNAL)
            _reply(conn, Reply(False, FailureReason.INTERNAL))
            return
        pieces = plan_pieces(src, dst, block_nbytes, piece_bytes)
        _reply(conn, Reply(True, piece_bytes=piece_bytes))
        failure = FailureReason.PEER_DIED
        try:
            with self.stream.active():
                self._send_pieces(group, request_id, pieces, shaper)
            failure = None
        except DropTransfer:
            failure = FailureReason.DROPPED
            conn.shutdown(socket.SHUT_RDWR)
            raise ChannelClosed("dropped by fault injection") from None
        finally:
            self.sender.registry.end_transfer(request_id, total_bytes(pieces), failure)
        # Recorded before `done` leaves: the receiver may read the stats the moment it
        # has `done` (as in the gRPC server).
        send_message(conn, Done(total_bytes(pieces)).to_json())

    def _serve_follow(self, conn: socket.socket, group, request: Follow) -> None:
        """push: each run of the export's blocks, as it is exported: its note, then its
        pieces (the receiver posts their receives on reading the note); `Waiting` while
        none comes; `Done` after the final one. The pair serves nothing else meanwhile:
        receivers follow on pairs of their own."""
        block_nbytes = self.sender.pool.layout.block_nbytes
        sent = 0
        try:
            for note in self.sender.pushed(request.request_id, request.first_block):
                if note is None:
                    send_message(conn, WAITING)
                    continue
                start = note.first_block - request.first_block
                dst = request.dst_block_ids[start : start + len(note.block_ids)]
                pieces = plan_pieces(note.block_ids, dst, block_nbytes, self.piece_bytes)
                send_message(conn, note.to_json())
                with self.stream.active():
                    self._send_pieces(group, request.request_id, pieces, self._shaper())
                sent += total_bytes(pieces)
        except ExportGone:
            _reply(conn, Reply(False, FailureReason.UNKNOWN_REQUEST, "export is gone"))
            return
        except DropTransfer:
            conn.shutdown(socket.SHUT_RDWR)
            raise ChannelClosed("dropped by fault injection") from None
        send_message(conn, Done(sent).to_json())

    def _send_pieces(self, group, request_id: str, pieces: list[Piece], shaper: Shaper) -> None:
        flat = flat_bytes(self.sender.pool.kv)
        faults = FaultPlan(self.options.faults, total_bytes(pieces), request_id)
        timeout = timedelta(seconds=self.options.timeout_s)
        beat = self.sender.lease_beats(request_id)
        shaper.start()
        pending = []  # all sends in flight at once: pieces pipeline instead of ping-ponging
        for piece in pieces:
            data = flat[piece.src : piece.src + piece.nbytes]
            if faults.hit(piece.offset, piece.nbytes):
                data = data.clone()
                data[0] = 255 - int(data[0])
            shaper.pace(piece.nbytes)
            pending.append(group.send([data], RECEIVER_RANK, 0))
            if shaper.active:  # a paced link must not queue ahead of its cap
                pending.pop().wait(timeout)
            beat()
        for work in pending:
            work.wait(timeout)
            beat()
        shaper.finish()

    def close(self) -> None:
        self.control.close()


def _reply(conn: socket.socket, reply: Reply) -> None:
    send_message(conn, reply.to_json())


def make_collective_sender(worker_id: str, pool: KVCachePool, options: TransportOptions):
    return RegistrySender("collective", worker_id, pool, options, [CollectiveServer])


@dataclass
class _Pair:
    conn: ControlConnection
    group: object
    lock: threading.Lock
    receiving: bool = False
    """Receives are posted on the group and not all complete: after a failure the group
    cannot be reused (a pending receive would match the next transfer's bytes)."""


class CollectiveReceiver(TransportReceiver):
    """Receiver half: one pair (control connection + group) per sender, built on demand."""

    def __init__(self, worker_id: str, pool: KVCachePool, options: TransportOptions):
        super().__init__("collective", worker_id, pool, options)
        self._pairs: dict[str, _Pair] = {}
        self._following: dict[tuple[str, int], list[_Pair]] = {}
        """Idle pairs of standing transfers (push), by sender control address: each
        follow holds a pair of its own for as long as its prompt prefills."""
        self._lock = threading.Lock()

    def _pair(self, ticket: ExportTicket, deadline: float) -> _Pair:
        # Built outside the lock: a dead sender's rendezvous must not stall other pairs.
        with self._lock:
            pair = self._pairs.get(ticket.sender_id)
        if pair is not None:
            return pair
        pair = self._build_pair(ticket, deadline)
        with self._lock:
            existing = self._pairs.setdefault(ticket.sender_id, pair)
        if existing is not pair:
            pair.conn.close()
            drop_group(pair.group)
        return existing

    def _build_pair(self, ticket: ExportTicket, deadline: float) -> _Pair:
        info = ticket.sender_endpoint.collective
        (host, port), (store_host, store_port) = info.control, info.store
        timeout = remaining(deadline, ticket)
        try:
            conn = ControlConnection(host, port, self.options, timeout)
            reply = Reply.from_json(conn.call(Pair(self.worker_id).to_json(), timeout))
        except (ChannelClosed, OSError) as exc:
            raise fail(ticket, FailureReason.PEER_DIED, f"control unreachable: {exc}") from None
        if not reply.ok:
            conn.close()
            raise fail(ticket, reply.failure, str(reply.to_json()))
        try:
            store = dist.TCPStore(store_host, store_port, None, False, timedelta(seconds=timeout))
            group = make_pair_group(
                store,
                reply.prefix,
                RECEIVER_RANK,
                self.options.dial_host,
                self.pool.kv.device,
                timeout,
            )
        except Exception as exc:
            conn.close()
            raise fail(ticket, FailureReason.PEER_DIED, f"pair rendezvous failed: {exc}") from None
        return _Pair(conn, group, threading.Lock())

    def _forget(self, ticket: ExportTicket, pair: _Pair) -> None:
        with self._lock:
            if self._pairs.get(ticket.sender_id) is pair:
                del self._pairs[ticket.sender_id]
        pair.conn.close()
        drop_group(pair.group)

    def _pull(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        deadline: float,
        verifier: BlockVerifier,
    ) -> str:
        if ticket.sender_endpoint.collective is None:
            raise fail(ticket, FailureReason.INTERNAL, "sender does not serve collective")
        pair = self._pair(ticket, deadline)
        with pair.lock:
            try:
                self._transfer(pair, ticket, dst_block_ids, deadline, verifier)
            except KVTransferError as exc:
                if exc.reason != FailureReason.UNKNOWN_REQUEST or pair.receiving:
                    self._forget(ticket, pair)
                raise
        return "collective"

    def _transfer(
        self, pair: _Pair, ticket, dst_block_ids: list[int], deadline: float, verifier
    ) -> None:
        request = Fetch(ticket.request_id, dst_block_ids, ticket.first_block)
        piece_bytes = ticket.sender_endpoint.collective.piece_bytes
        try:
            # Receives posted with the fetch: the first piece flies without waiting for
            # the reply's round trip (a third of a 1 MiB transfer here).
            pair.conn.send(request.to_json())
            works, pieces = self._post(pair, ticket, dst_block_ids, piece_bytes)
            reply = Reply.from_json(pair.conn.recv(remaining(deadline, ticket)))
            if not reply.ok:
                raise fail(ticket, reply.failure, str(reply.to_json()))
            if reply.piece_bytes != piece_bytes:
                changed = f"piece size changed: {reply.to_json()}"
                raise fail(ticket, FailureReason.INTERNAL, changed)
            for piece, work in zip(pieces, works, strict=True):
                work.wait(timedelta(seconds=remaining(deadline, ticket)))
                verifier.landed(piece.offset + piece.nbytes)  # while the next piece flies
            pair.receiving = False
            done = pair.conn.recv(remaining(deadline, ticket))
        except KVTransferError:
            raise
        except Exception as exc:
            raise self._classify(ticket, exc) from None
        if Done.from_json(done) is None:
            raise fail(ticket, FailureReason.INTERNAL, f"unexpected reply {done}")

    def _post(self, pair: _Pair, ticket, dst_block_ids: list[int], piece_bytes: int):
        """Post one receive per piece straight into the destination blocks."""
        block_nbytes = self.pool.layout.block_nbytes
        pieces = plan_pieces(ticket.block_ids, dst_block_ids, block_nbytes, piece_bytes)
        flat = flat_bytes(self.pool.kv)
        pair.receiving = True
        works = [pair.group.recv([flat[p.dst : p.dst + p.nbytes]], SENDER_RANK, 0) for p in pieces]
        return works, pieces

    def _classify(self, ticket: ExportTicket, exc: Exception) -> KVTransferError:
        """Tell a dead sender from a dropped or timed-out transfer after a wait failed."""
        control = ticket.sender_endpoint.collective.control
        text = str(exc).lower()
        if not responsive(control.host, control.port, self.options):
            reason = FailureReason.PEER_DIED
        elif isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text:
            reason = FailureReason.TIMEOUT
        else:
            reason = FailureReason.DROPPED
        return fail(ticket, reason, f"{type(exc).__name__}: {exc}")

    def _follow(self, followed: FollowedSegments, timeout_s: float) -> str:
        ticket = followed.ticket
        info = ticket.sender_endpoint.collective
        if info is None:
            raise fail(ticket, FailureReason.INTERNAL, "sender does not serve collective")
        address = (info.control.host, info.control.port)
        with self._lock:
            idle = self._following.get(address)
            pair = idle.pop() if idle else None
        if pair is None:
            pair = self._build_pair(ticket, time.monotonic() + timeout_s)
        try:
            self._land_followed(pair, followed, timeout_s, info.piece_bytes)
        except BaseException:
            pair.conn.close()
            drop_group(pair.group)
            raise
        with self._lock:
            self._following.setdefault(address, []).append(pair)
        return "collective"

    def _land_followed(
        self, pair: _Pair, followed: FollowedSegments, timeout_s: float, piece_bytes
    ):
        ticket = followed.ticket
        block_nbytes = self.pool.layout.block_nbytes
        flat = flat_bytes(self.pool.kv)
        request = Follow(ticket.request_id, followed.first_block, followed.dst)
        try:
            pair.conn.send(request.to_json())
            while True:
                deadline = time.monotonic() + timeout_s
                message = pair.conn.recv(remaining(deadline, ticket))
                remaining(deadline, ticket)  # cancelled meanwhile?
                note = SegmentNote.from_json(message)
                if note is None:
                    if message.get("waiting"):
                        continue
                    if Done.from_json(message) is not None:
                        break
                    raise fail(ticket, Reply.from_json(message).failure, str(message))
                segment, dst, verifier, arrived = followed.open(note)
                pieces = plan_pieces(segment.block_ids, dst, block_nbytes, piece_bytes)
                works = [
                    pair.group.recv([flat[p.dst : p.dst + p.nbytes]], SENDER_RANK, 0)
                    for p in pieces
                ]
                for piece, work in zip(pieces, works, strict=True):
                    work.wait(timedelta(seconds=remaining(deadline, ticket)))
                    verifier.landed(piece.offset + piece.nbytes)
                followed.landed(segment, verifier, arrived)
        except KVTransferError:
            raise
        except Exception as exc:
            raise self._classify(ticket, exc) from None
        followed.ended()

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        try:
            pair = self._pair(ticket, time.monotonic() + timeout_s)
        except KVTransferError:
            return False
        with pair.lock:
            try:
                answer = pair.conn.call(Heartbeat(ticket.request_id).to_json(), timeout_s)
            except (ChannelClosed, OSError):
                self._forget(ticket, pair)
                return False
        return Reply.from_json(answer).ok

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            pairs += [p for idle in self._following.values() for p in idle]
            self._following = {}
        for pair in pairs:
            pair.conn.close()
            drop_group(pair.group)
