"""`grpc`: KV blocks streamed over the `KVTransfer` service of proto/kv_transfer.proto.

The sender starts a gRPC server at worker start, bound to `bind_host` (loopback by
default) with message limits set. Per transfer the receiver calls `Fetch` with its
destination block ids and the cluster token in metadata; the server marks the export
TRANSFERRING and streams `chunk`s (pacing, faults and lease heartbeats in between),
then `done`; any refusal travels in the stream as `error`. A stream that ends without
`done` is a drop; a sender that vanished is UNAVAILABLE. No pickle on this wire.
"""

from __future__ import annotations

import hmac
import logging
import threading
from concurrent import futures

import grpc
import grpc.experimental
import numpy as np
import torch

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket, FailureReason
from kv_transfer.blockio import PoolBytes, plan_pieces, requested_blocks, total_bytes
from kv_transfer.config import TransportOptions
from kv_transfer.faults import DropTransfer, FaultPlan
from kv_transfer.integrity import BlockVerifier
from kv_transfer.receiver import TransportReceiver, fail, remaining
from kv_transfer.sender import RegistrySender
from kv_transfer.shaping import Shaper
from kv_transfer.transports.grpc_wire import deserialize_response, encode_chunk, serialize_response
from proto import kv_transfer_pb2 as pb
from proto import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

TOKEN_KEY = "x-pdserve-token"
MESSAGE_BYTES = 1 << 20
"""Largest chunk per message, below `chunk_bytes`: Python gRPC moves 1 MiB messages
25-60% faster than 4 MiB ones here (bigger messages stall the one-in-flight writer)."""
SERVICE = "pdserve.kv_transfer.KVTransfer"

_STATUS_REASONS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureReason.TIMEOUT,
    grpc.StatusCode.UNAUTHENTICATED: FailureReason.UNAUTHORIZED,
    grpc.StatusCode.UNAVAILABLE: FailureReason.PEER_DIED,
    grpc.StatusCode.CANCELLED: FailureReason.DROPPED,
}


def server_channel_options(options: TransportOptions) -> list[tuple[str, int]]:
    """Message limits, for the sender's server (and under the receiver's channel)."""
    return [
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.max_receive_message_length", options.max_message_bytes),
    ]


def client_channel_options(options: TransportOptions) -> list[tuple[str, int]]:
    """The receiver's channel: the server's limits, and `Fetch` streams read on the
    calling thread. grpcio otherwise starts a thread per call to drive the stream (the
    channel's spin thread, when no other call is active): a 1 MiB fetch took 4-10% less
    without it, and the bare grpcio ceiling of `pdserve bench
    transfer` reads its stream the same way."""
    return [
        *server_channel_options(options),
        (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    ]


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, sender: RegistrySender):
        self.sender = sender
        self.options = sender.options
        self._pool_bytes = PoolBytes()

    def _authorize(self, context) -> None:
        token = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
        if not hmac.compare_digest(str(token), self.options.token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    def Heartbeat(self, request, context):
        self._authorize(context)
        return pb.HeartbeatReply(alive=self.sender.heartbeat(request.request_id))

    def Fetch(self, request, context):
        self._authorize(context)
        record = self.sender.registry.begin_transfer(request.request_id)
        if record is None:
            yield _error(FailureReason.UNKNOWN_REQUEST, "export is gone (acked, expired, aborted)")
            return
        dst = list(request.dst_block_ids)
        src = requested_blocks(record.block_ids, len(dst))
        if src is None:
            self.sender.registry.end_transfer(request.request_id, 0, FailureReason.INTERNAL)
            yield _error(
                FailureReason.INTERNAL, f"{len(dst)} dst blocks for {len(record.block_ids)}"
            )
            return
        shaper = Shaper(self.options.bandwidth_bytes_per_s, self.options.added_latency_s)
        block_nbytes = self.sender.pool.layout.block_nbytes
        piece_bytes = min(shaper.piece_bytes(self.options.chunk_bytes), MESSAGE_BYTES)
        pieces = plan_pieces(src, dst, block_nbytes, piece_bytes)
        failure = FailureReason.PEER_DIED  # until proven otherwise: the client went away
        try:
            yield from self._stream(request.request_id, pieces, shaper)
            failure = None
        except DropTransfer:
            failure = FailureReason.DROPPED
        finally:
            self.sender.registry.end_transfer(request.request_id, total_bytes(pieces), failure)
        if failure is None:
            # Recorded before `done` leaves: the receiver cancels the call as soon as it
            # reads it, and this generator may never be resumed after that yield.
            done = pb.Done(num_bytes=total_bytes(pieces), num_chunks=len(pieces))
            yield pb.FetchResponse(done=done)

    def _stream(self, request_id: str, pieces, shaper: Shaper):
        flat, host = self._pool_bytes.views(self.sender.pool.kv)
        faults = FaultPlan(self.options.faults, total_bytes(pieces), request_id)
        beat = self.sender.lease_beats(request_id)
        shaper.start()
        for piece in pieces:
            corrupt = faults.hit(piece.offset, piece.nbytes)
            end = piece.src + piece.nbytes
            data = (
                host[piece.src : end] if host is not None else flat[piece.src : end].cpu().numpy()
            )
            if corrupt:
                data = data.copy()
                data[0] = 255 - data[0]
            shaper.pace(piece.nbytes)
            yield encode_chunk(piece.offset, data)
            beat()
        shaper.finish()


def _error(reason: FailureReason, message: str) -> pb.FetchResponse:
    return pb.FetchResponse(error=pb.Error(reason=reason.value, message=message))


def _handlers(servicer: _Servicer) -> grpc.GenericRpcHandler:
    """The generated servicer's methods, with chunks serialized by grpc_wire (no protobuf
    copy of the payload); the service and messages are those of the .proto."""
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Fetch": grpc.unary_stream_rpc_method_handler(
                servicer.Fetch,
                request_deserializer=pb.FetchRequest.FromString,
                response_serializer=serialize_response,
            ),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                servicer.Heartbeat,
                request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.HeartbeatReply.SerializeToString,
            ),
        },
    )


class GrpcServer:
    """Sender half: the gRPC server of one prefill worker."""

    def __init__(self, sender: RegistrySender):
        options = sender.options
        self.host = options.dial_host
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-grpc"),
            options=server_channel_options(options),
        )
        self.server.add_generic_rpc_handlers((_handlers(_Servicer(sender)),))
        self.port = self.server.add_insecure_port(f"{options.bind_host}:0")
        if not self.port:
            raise OSError(f"could not bind the gRPC KV server on {options.bind_host}")
        self.server.start()

    def endpoint(self) -> dict:
        return {"grpc": {"address": f"{self.host}:{self.port}"}}

    def close(self) -> None:
        self.server.stop(grace=None)


def make_grpc_sender(worker_id: str, pool: KVCachePool, options: TransportOptions):
    return RegistrySender("grpc", worker_id, pool, options, [GrpcServer])


def _run_lengths(ids: list[int]) -> list[int]:
    """For each position, how many blocks from there on have consecutive ids."""
    lengths = [1] * len(ids)
    for i in range(len(ids) - 2, -1, -1):
        if ids[i + 1] == ids[i] + 1:
            lengths[i] = lengths[i + 1] + 1
    return lengths


class GrpcReceiver(TransportReceiver):
    """Receiver half: one channel per sender address, kept for the worker's life."""

    def __init__(self, worker_id: str, pool: KVCachePool, options: TransportOptions):
        super().__init__("grpc", worker_id, pool, options)
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _fetch_call(self, ticket: ExportTicket):
        return self._channel(ticket).unary_stream(
            f"/{SERVICE}/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=deserialize_response,
        )

    def _stub(self, ticket: ExportTicket) -> pb_grpc.KVTransferStub:
        return pb_grpc.KVTransferStub(self._channel(ticket))

    def _channel(self, ticket: ExportTicket) -> grpc.Channel:
        info = ticket.sender_endpoint.get("grpc")
        if info is None:
            raise fail(ticket, FailureReason.INTERNAL, "sender does not serve grpc")
        with self._lock:
            channel = self._channels.get(info["address"])
            if channel is None:
                channel = grpc.insecure_channel(
                    info["address"], options=client_channel_options(self.options)
                )
                self._channels[info["address"]] = channel
        return channel

    def _pull(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        deadline: float,
        verifier: BlockVerifier,
    ) -> str:
        fetch = self._fetch_call(ticket)
        request = pb.FetchRequest(
            request_id=ticket.request_id, receiver_id=self.worker_id, dst_block_ids=dst_block_ids
        )
        metadata = [(TOKEN_KEY, self.options.token)]
        call = fetch(request, timeout=remaining(deadline, ticket), metadata=metadata)
        try:
            self._consume(call, ticket, dst_block_ids, verifier)
        except grpc.RpcError as exc:
            reason = _STATUS_REASONS.get(exc.code(), FailureReason.INTERNAL)
            raise fail(ticket, reason, f"gRPC {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()
        return "grpc"

    def _consume(self, call, ticket: ExportTicket, dst_block_ids: list[int], verifier) -> None:
        tensor, host = self._bytes.views(self.pool.kv)
        flat = tensor if host is None else host  # numpy on a CPU pool
        block_nbytes = self.pool.layout.block_nbytes
        runs = _run_lengths(dst_block_ids)
        expected = len(dst_block_ids) * block_nbytes
        offset = 0
        for response in call:
            if isinstance(response, tuple):  # a chunk, decoded by grpc_wire
                _, chunk_offset, payload = response
                if chunk_offset != offset or offset + len(payload) > expected:
                    raise fail(ticket, FailureReason.INTERNAL, f"chunk at {chunk_offset}")
                data = np.frombuffer(payload, dtype=np.uint8)
                self._write(flat, dst_block_ids, runs, block_nbytes, offset, data, verifier)
                offset += len(payload)
                continue
            kind = response.WhichOneof("kind")
            if kind == "error":
                raise fail(ticket, FailureReason(response.error.reason), response.error.message)
            if kind == "done":
                if offset != expected:
                    raise fail(ticket, FailureReason.INTERNAL, f"{offset} of {expected} bytes")
                return
        raise fail(
            ticket, FailureReason.DROPPED, f"stream ended after {offset} of {expected} bytes"
        )

    @staticmethod
    def _write(flat, dst_ids, runs, block_nbytes: int, offset: int, data, verifier) -> None:
        """Copy stream bytes at `offset` into our blocks, split where our ids jump; on a
        CPU pool (`flat` a numpy view of it) the verifier copies them, summing each block
        right behind its copy; a device pool (`flat` a tensor) takes a host copy."""
        done = 0
        while done < data.size:
            index, within = divmod(offset + done, block_nbytes)
            n = min(data.size - done, runs[index] * block_nbytes - within)
            start = dst_ids[index] * block_nbytes + within
            piece = data[done : done + n]
            if isinstance(flat, torch.Tensor):
                flat[start : start + n].copy_(torch.from_numpy(piece.copy()))
                verifier.landed(offset + done + n)
            else:
                verifier.copy_piece(piece, flat[start : start + n], offset + done, False)
            done += n

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        try:
            reply = self._stub(ticket).Heartbeat(
                pb.HeartbeatRequest(request_id=ticket.request_id),
                timeout=timeout_s,
                metadata=[(TOKEN_KEY, self.options.token)],
            )
        except grpc.RpcError:
            return False
        return reply.alive

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
