"""`grpc`: KV blocks streamed over the `KVTransfer` service of proto/kv_transfer.proto.

The sender starts a gRPC server at worker start, bound to `bind_host` (loopback by
default), speaking TLS when `tls_certfile` is set, with message limits set: chunks go
out up to `max_message_bytes`, requests come in up to `REQUEST_BYTES`. Per transfer
the receiver calls `Fetch` with its destination block ids and the cluster token in
metadata; a call without the token is refused UNAUTHENTICATED from its metadata alone,
before its request is read (`_TokenCheck`), and at most `max_connections` calls are
held at once. The server marks the export TRANSFERRING and streams `chunk`s (pacing,
faults and lease heartbeats in between), then `done`; any refusal travels in the stream
as `error`. A stream that ends without `done` is a drop; a sender that vanished is
UNAVAILABLE. No pickle on this wire.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import grpc.experimental
import numpy as np
import torch

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket, FailureReason
from kv_transfer.blockio import PoolBytes, plan_pieces, requested_blocks, total_bytes
from kv_transfer.config import TransportOptions
from kv_transfer.control import token_matches
from kv_transfer.control_messages import SegmentNote
from kv_transfer.endpoints import GrpcEndpoint
from kv_transfer.faults import DropTransfer, FaultPlan
from kv_transfer.integrity import BlockVerifier
from kv_transfer.push import ExportGone, FollowedSegments
from kv_transfer.receiver import TransportReceiver, fail, remaining
from kv_transfer.sender import RegistrySender
from kv_transfer.shaping import Shaper
from kv_transfer.tls import read_pem
from kv_transfer.transfer_stream import TransferStream
from kv_transfer.transports.grpc_wire import deserialize_response, encode_chunk, serialize_response
from proto import kv_transfer_pb2 as pb
from proto import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

TOKEN_KEY = "x-pdserve-token"
MESSAGE_BYTES = 1 << 20
"""Largest chunk per message, below `chunk_bytes`: Python gRPC moves 1 MiB messages
25-60% faster than 4 MiB ones here (bigger messages stall the one-in-flight writer)."""
SERVICE = "pdserve.kv_transfer.KVTransfer"
REQUEST_BYTES = 1 << 20
"""Largest request the server reads: a Fetch lists its destination block ids (a few
bytes each: 1 MiB holds 200k), a Heartbeat names one request."""
SERVER_THREADS = 8

_STATUS_REASONS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureReason.TIMEOUT,
    grpc.StatusCode.UNAUTHENTICATED: FailureReason.UNAUTHORIZED,
    grpc.StatusCode.UNAVAILABLE: FailureReason.PEER_DIED,
    grpc.StatusCode.CANCELLED: FailureReason.DROPPED,
}


def server_channel_options(options: TransportOptions) -> list[tuple[str, int]]:
    """Message limits of the sender's server: chunks out, small requests in."""
    return [
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.max_receive_message_length", REQUEST_BYTES),
    ]


def client_channel_options(options: TransportOptions) -> list[tuple[str, int | str]]:
    """The receiver's channel: the server's limits mirrored, the name TLS checks the
    server's certificate for (when not the dialled address), and `Fetch` streams read
    on the calling thread. grpcio otherwise starts a thread per call to drive the stream
    (the channel's spin thread, when no other call is active): a 1 MiB fetch took 4-10%
    less without it, and the bare grpcio ceiling of `pdserve bench transfer` reads its
    stream the same way."""
    channel_options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", REQUEST_BYTES),
        ("grpc.max_receive_message_length", options.max_message_bytes),
        (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    ]
    if options.tls_enabled and options.tls_server_name:
        channel_options.append(("grpc.ssl_target_name_override", options.tls_server_name))
    return channel_options


def _refuse(request_iterator, context) -> None:
    """Ends an unauthenticated call without reading its request (a streamed request is
    read only as the handler iterates it, and this one never does)."""
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")


_REFUSED = grpc.stream_unary_rpc_method_handler(_refuse)


class _TokenCheck(grpc.ServerInterceptor):
    """Checks the cluster token in a call's metadata before any handler runs."""

    def __init__(self, token: str):
        self._token = token.encode("utf-8", "surrogatepass")

    def intercept_service(self, continuation, handler_call_details):
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_KEY:
                presented = value
        if token_matches(presented, self._token):
            return continuation(handler_call_details)
        return _REFUSED


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, sender: RegistrySender):
        self.sender = sender
        self.options = sender.options
        self._pool_bytes = PoolBytes()
        self._transfer = TransferStream(sender.pool.kv.device)
        """Device pools: each piece's copy to the host runs here, off compute's stream."""

    # Calls reach these methods only past `_TokenCheck`.

    def Heartbeat(self, request, context):
        return pb.HeartbeatReply(alive=self.sender.heartbeat(request.request_id))

    def Fetch(self, request, context):
        record = self.sender.registry.begin_transfer(request.request_id)
        if record is None:
            yield _error(FailureReason.UNKNOWN_REQUEST, "export is gone (acked, expired, aborted)")
            return
        dst = list(request.dst_block_ids)
        first = request.first_block if request.HasField("first_block") else None
        src = requested_blocks(record.block_ids, len(dst), first)
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

    def Follow(self, request, context):
        """push: each run of the export's blocks as it is exported: its note, then its
        chunks (offsets from the run's start); `waiting` while none comes."""
        request_id = request.request_id
        first = request.first_block if request.HasField("first_block") else 0
        dst = list(request.dst_block_ids)
        block_nbytes = self.sender.pool.layout.block_nbytes
        sent = 0
        try:
            for note in self.sender.pushed(request_id, first):
                if note is None:
                    yield pb.FetchResponse(waiting=pb.Waiting())
                    continue
                start = note.first_block - first
                part = dst[start : start + len(note.block_ids)]
                if len(part) != len(note.block_ids):
                    yield _error(FailureReason.INTERNAL, f"{len(dst)} dst blocks from {first}")
                    return
                yield pb.FetchResponse(segment=_segment_message(note))
                shaper = Shaper(self.options.bandwidth_bytes_per_s, self.options.added_latency_s)
                piece_bytes = min(shaper.piece_bytes(self.options.chunk_bytes), MESSAGE_BYTES)
                pieces = plan_pieces(note.block_ids, part, block_nbytes, piece_bytes)
                yield from self._stream(request_id, pieces, shaper)
                sent += total_bytes(pieces)
        except ExportGone:
            yield _error(FailureReason.UNKNOWN_REQUEST, "export is gone (acked, expired, aborted)")
            return
        except DropTransfer:
            return
        yield pb.FetchResponse(done=pb.Done(num_bytes=sent))

    def _stream(self, request_id: str, pieces, shaper: Shaper):
        flat, host = self._pool_bytes.views(self.sender.pool.kv)
        faults = FaultPlan(self.options.faults, total_bytes(pieces), request_id)
        beat = self.sender.lease_beats(request_id)
        shaper.start()
        for piece in pieces:
            corrupt = faults.hit(piece.offset, piece.nbytes)
            end = piece.src + piece.nbytes
            if host is not None:
                data = host[piece.src : end]
            else:
                with self._transfer.active():  # per piece: this generator yields between
                    data = flat[piece.src : end].cpu().numpy()
            if corrupt:
                data = data.copy()
                data[0] = 255 - data[0]
            shaper.pace(piece.nbytes)
            yield encode_chunk(piece.offset, data)
            beat()
        shaper.finish()


def _error(reason: FailureReason, message: str) -> pb.FetchResponse:
    return pb.FetchResponse(error=pb.Error(reason=reason.value, message=message))


def _segment_message(note: SegmentNote) -> pb.SegmentNote:
    return pb.SegmentNote(
        first_block=note.first_block,
        block_ids=note.block_ids,
        checksums=note.checksums,
        num_tokens=note.num_tokens,
        final=note.final,
    )


def _segment_note(message: pb.SegmentNote) -> SegmentNote:
    return SegmentNote(
        message.first_block,
        list(message.block_ids),
        list(message.checksums),
        message.num_tokens,
        message.final,
    )


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
            "Follow": grpc.unary_stream_rpc_method_handler(
                servicer.Follow,
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
            futures.ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="kv-grpc"),
            handlers=(_handlers(_Servicer(sender)),),
            interceptors=(_TokenCheck(options.token),),
            options=server_channel_options(options),
            maximum_concurrent_rpcs=options.max_connections,
        )
        address = f"{_host_for_address(options.bind_host)}:0"
        if options.tls_enabled:
            key_and_cert = (read_pem(options.tls_keyfile), read_pem(options.tls_certfile))
            credentials = grpc.ssl_server_credentials([key_and_cert])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"could not bind the gRPC KV server on {options.bind_host}")
        self.server.start()

    def endpoint(self) -> GrpcEndpoint:
        return GrpcEndpoint(f"{_host_for_address(self.host)}:{self.port}")

    def close(self) -> None:
        self.server.stop(grace=None)


def _host_for_address(host: str) -> str:
    """`host` as the host part of a gRPC address (an IPv6 address goes in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def make_grpc_sender(worker_id: str, pool: KVCachePool, options: TransportOptions):
    return RegistrySender("grpc", worker_id, pool, options, [GrpcServer])


class _Watchdog:
    """Calls `fire()` (cancels a call) once `timeout_s` passed without a `kick`."""

    def __init__(self, timeout_s: float, fire):
        self.timeout_s = timeout_s
        self.fired = False
        self._fire = fire
        self._kicked = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kv-follow-watch", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._kicked.set()

    def stop(self) -> None:
        self._stopped.set()
        self._kicked.set()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            if not self._kicked.wait(self.timeout_s):
                self.fired = True
                self._fire()
                return
            self._kicked.clear()


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

    def _fetch_call(self, ticket: ExportTicket, method: str = "Fetch"):
        return self._channel(ticket).unary_stream(
            f"/{SERVICE}/{method}",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=deserialize_response,
        )

    def _stub(self, ticket: ExportTicket) -> pb_grpc.KVTransferStub:
        return pb_grpc.KVTransferStub(self._channel(ticket))

    def _channel(self, ticket: ExportTicket) -> grpc.Channel:
        info = ticket.sender_endpoint.grpc
        if info is None:
            raise fail(ticket, FailureReason.INTERNAL, "sender does not serve grpc")
        with self._lock:
            channel = self._channels.get(info.address)
            if channel is None:
                channel = self._open_channel(info.address)
                self._channels[info.address] = channel
        return channel

    def _open_channel(self, address: str) -> grpc.Channel:
        channel_options = client_channel_options(self.options)
        if not self.options.tls_enabled:
            return grpc.insecure_channel(address, options=channel_options)
        credentials = grpc.ssl_channel_credentials(read_pem(self.options.tls_ca_file))
        return grpc.secure_channel(address, credentials, options=channel_options)

    def _pull(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        deadline: float,
        verifier: BlockVerifier,
    ) -> str:
        fetch = self._fetch_call(ticket)
        request = pb.FetchRequest(
            request_id=ticket.request_id,
            receiver_id=self.worker_id,
            dst_block_ids=dst_block_ids,
            first_block=ticket.first_block,
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

    def _follow(self, followed: FollowedSegments, timeout_s: float) -> str:
        ticket = followed.ticket
        request = pb.FetchRequest(
            request_id=ticket.request_id,
            receiver_id=self.worker_id,
            dst_block_ids=followed.dst,
            first_block=followed.first_block,
        )
        metadata = [(TOKEN_KEY, self.options.token)]
        call = self._fetch_call(ticket, "Follow")(request, metadata=metadata)
        # The call lasts as long as the prompt prefills: no deadline on it, but one on
        # each message, kept by a watchdog (the sender's `waiting` notes are frequent).
        watchdog = _Watchdog(timeout_s, call.cancel)
        try:
            self._land_followed(call, followed, watchdog)
        except grpc.RpcError as exc:
            if watchdog.fired:
                raise fail(ticket, FailureReason.TIMEOUT, "sender silent on follow") from None
            reason = _STATUS_REASONS.get(exc.code(), FailureReason.INTERNAL)
            raise fail(ticket, reason, f"gRPC {exc.code().name}: {exc.details()}") from None
        finally:
            watchdog.stop()
            call.cancel()
        return "grpc"

    def _land_followed(self, call, followed: FollowedSegments, watchdog) -> None:
        ticket = followed.ticket
        tensor, host = self._bytes.views(self.pool.kv)
        flat = tensor if host is None else host
        block_nbytes = self.pool.layout.block_nbytes
        current = None  # (segment, dst, runs, verifier, arrived, expected bytes, offset)
        for response in call:
            watchdog.kick()
            remaining(time.monotonic() + watchdog.timeout_s, ticket)  # cancelled?
            if isinstance(response, tuple):  # a chunk of the current segment
                if current is None:
                    raise fail(ticket, FailureReason.INTERNAL, "chunk before its segment")
                segment, dst, runs, verifier, arrived, expected, offset = current
                _, chunk_offset, payload = response
                if chunk_offset != offset or offset + len(payload) > expected:
                    raise fail(ticket, FailureReason.INTERNAL, f"chunk at {chunk_offset}")
                data = np.frombuffer(payload, dtype=np.uint8)
                self._write(flat, dst, runs, block_nbytes, offset, data, verifier)
                offset += len(payload)
                current = (segment, dst, runs, verifier, arrived, expected, offset)
                if offset == expected:
                    followed.landed(segment, verifier, arrived)
                    current = None
                continue
            kind = response.WhichOneof("kind")
            if kind == "segment":
                segment, dst, verifier, arrived = followed.open(_segment_note(response.segment))
                expected = len(dst) * block_nbytes
                current = (segment, dst, _run_lengths(dst), verifier, arrived, expected, 0)
            elif kind == "error":
                raise fail(ticket, FailureReason(response.error.reason), response.error.message)
            elif kind == "done":
                if current is not None:
                    raise fail(ticket, FailureReason.INTERNAL, "done mid-segment")
                followed.ended()
                return
        raise fail(ticket, FailureReason.DROPPED, "follow stream ended without done")

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
