"""`shm`: same-node transfer through the sender's KV pool living in shared memory.

At start the sender re-homes its pool in a file under `shm_dir` (/dev/shm) and starts
a control server. Per transfer the receiver:

    1. maps the sender's pool file (once per sender, kept),
    2. `begin` on the control channel: the sender marks the export TRANSFERRING and
       extends the lease, or says it is gone,
    3. copies the blocks itself, one memcpy per piece (no socket in the data path),
       heartbeating if pacing makes the copy outlast a third of the lease,
    4. `end`: the sender records the transfer; a sender that died meanwhile fails it.

Checksums (verified by the caller after `_pull`) catch any block the sender reused
under us. Faults: drop/stall/kill strike in the sender's control handler; corrupt
strikes in the receiver's copy (the sender never touches these bytes).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import socket
import time

import torch

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket, FailureReason
from kv_transfer.blockio import copy_pieces, flat_bytes, plan_pieces, total_bytes
from kv_transfer.config import FaultOptions, TransportOptions
from kv_transfer.control import (
    ChannelClosed,
    ControlConnection,
    ControlServer,
    recv_message,
    responsive,
    send_message,
)
from kv_transfer.faults import DropTransfer, FaultPlan
from kv_transfer.receiver import TransportReceiver, fail, remaining
from kv_transfer.sender import RegistrySender
from kv_transfer.shaping import Shaper

logger = logging.getLogger(__name__)

FILE_PREFIX = "pdserve-kv-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_files(shm_dir: str) -> None:
    """Delete pool files of senders that died without closing (name ends in their pid)."""
    for path in glob.glob(os.path.join(shm_dir, f"{FILE_PREFIX}*.kv")):
        try:
            pid = int(path.rsplit("-", 1)[1].removesuffix(".kv"))
        except ValueError:
            continue
        if not _pid_alive(pid):
            _unlink_quietly(path)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ShmServer:
    """Sender half: owns the pool file and answers begin / heartbeat / end."""

    def __init__(self, sender: RegistrySender):
        self.sender = sender
        options = sender.options
        pool = sender.pool
        if pool.kv.device.type != "cpu":
            raise ValueError("the shm transport needs a CPU KV pool; use collective for CUDA")
        self.owns_file = pool.shm_path is None
        if self.owns_file:
            remove_stale_files(options.shm_dir)
            safe_id = "".join(c if c.isalnum() else "_" for c in sender.worker_id)
            path = os.path.join(options.shm_dir, f"{FILE_PREFIX}{safe_id}-{os.getpid()}.kv")
            pool.move_to_shared_memory(path)
        self.path = pool.shm_path
        self.faults: FaultOptions = options.faults
        self.control = ControlServer(
            options.bind_host, options.token, self._handle, f"kv-shm-{sender.worker_id}"
        )

    def endpoint(self) -> dict:
        return {
            "shm": {
                "path": self.path,
                "nbytes": self.sender.pool.kv.numel() * self.sender.pool.kv.element_size(),
                "control": [self.sender.options.dial_host, self.control.port],
            }
        }

    def _handle(self, conn: socket.socket, message: dict) -> None:
        while True:
            op, request_id = message.get("op"), str(message.get("request_id", ""))
            if op == "begin":
                self._begin(conn, request_id)
            elif op == "heartbeat":
                alive = self.sender.heartbeat(request_id)
                send_message(conn, {"ok": alive, "reason": "unknown_request"})
            elif op == "end":
                self._end(conn, request_id, message)
            else:
                send_message(conn, {"ok": False, "reason": "internal", "message": f"op {op}"})
            message = recv_message(conn)

    def _begin(self, conn: socket.socket, request_id: str) -> None:
        plan = FaultPlan(self.faults, 1, request_id)
        if plan.mode in ("drop", "stall"):
            try:
                plan.hit(0, 1)
            except DropTransfer:
                conn.shutdown(socket.SHUT_RDWR)
                raise ChannelClosed("dropped by fault injection") from None
        record = self.sender.registry.begin_transfer(request_id)
        if record is None:
            send_message(conn, {"ok": False, "reason": "unknown_request"})
        else:
            send_message(conn, {"ok": True})

    def _end(self, conn: socket.socket, request_id: str, message: dict) -> None:
        if self.faults.mode == "kill":
            FaultPlan(self.faults, 1, request_id).hit(0, 1)
        failure = None if message.get("ok") else FailureReason(message.get("reason", "internal"))
        self.sender.registry.end_transfer(request_id, int(message.get("nbytes", 0)), failure)
        send_message(conn, {"ok": True})

    def close(self) -> None:
        self.control.close()
        if self.owns_file and self.path:
            _unlink_quietly(self.path)


def make_shm_sender(worker_id: str, pool: KVCachePool, options: TransportOptions):
    return RegistrySender("shm", worker_id, pool, options, [ShmServer])


class ShmReceiver(TransportReceiver):
    """Receiver half: maps each sender's pool file once and copies out of it."""

    def __init__(self, worker_id: str, pool: KVCachePool, options: TransportOptions):
        super().__init__("shm", worker_id, pool, options)
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def _mapped(self, ticket: ExportTicket) -> torch.Tensor:
        info = ticket.sender_endpoint["shm"]
        path, nbytes = info["path"], int(info["nbytes"])
        cached = self._maps.get(path)
        if cached is not None:
            return cached[1]
        try:
            # Open without O_CREAT: a vanished file must fail, not be recreated empty.
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise fail(ticket, FailureReason.PEER_DIED, f"no pool file {path}") from None
        try:
            if os.fstat(fd).st_size != nbytes:
                raise fail(ticket, FailureReason.LAYOUT_MISMATCH, f"{path} is not {nbytes} B")
            region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        flat = torch.frombuffer(region, dtype=torch.uint8)
        self._maps[path] = (region, flat)
        return flat

    def _connect(self, ticket: ExportTicket, deadline: float) -> ControlConnection:
        host, port = ticket.sender_endpoint["shm"]["control"]
        try:
            return ControlConnection(host, port, self.options.token, remaining(deadline, ticket))
        except OSError as exc:
            raise fail(ticket, FailureReason.PEER_DIED, f"control unreachable: {exc}") from None

    def _call(self, conn, ticket, deadline: float, message: dict) -> dict:
        """One control round trip, with failures mapped to typed reasons."""
        try:
            reply = conn.call(
                {**message, "request_id": ticket.request_id}, remaining(deadline, ticket)
            )
        except TimeoutError:
            raise fail(ticket, FailureReason.TIMEOUT, f"sender silent on {message['op']}") from None
        except (ChannelClosed, OSError) as exc:
            host, port = ticket.sender_endpoint["shm"]["control"]
            reason = (
                FailureReason.DROPPED
                if responsive(host, port, self.options.token)
                else FailureReason.PEER_DIED
            )
            raise fail(ticket, reason, f"control channel lost on {message['op']}: {exc}") from None
        if not reply.get("ok"):
            reason = FailureReason(reply.get("reason", "internal"))
            raise fail(ticket, reason, f"sender refused {message['op']}: {reply}")
        return reply

    def _pull(self, ticket: ExportTicket, dst_block_ids: list[int], deadline: float) -> str:
        if ticket.sender_endpoint.get("shm") is None:
            raise fail(ticket, FailureReason.INTERNAL, "sender does not serve shm")
        src = self._mapped(ticket)
        conn = self._connect(ticket, deadline)
        try:
            self._call(conn, ticket, deadline, {"op": "begin"})
            nbytes = self._copy(conn, ticket, src, dst_block_ids, deadline)
            self._call(conn, ticket, deadline, {"op": "end", "ok": True, "nbytes": nbytes})
        finally:
            conn.close()
        return "shm"

    def _copy(self, conn, ticket, src: torch.Tensor, dst_block_ids, deadline: float) -> int:
        shaper = Shaper(self.options.bandwidth_bytes_per_s, self.options.added_latency_s)
        chunk = shaper.piece_bytes(self.options.chunk_bytes)
        pieces = plan_pieces(ticket.block_ids, dst_block_ids, self.pool.layout.block_nbytes, chunk)
        corrupt_only = FaultOptions(
            mode="corrupt" if self.options.faults.mode == "corrupt" else "none",
            probability=self.options.faults.probability,
            after_fraction=self.options.faults.after_fraction,
        )
        faults = FaultPlan(corrupt_only, total_bytes(pieces), ticket.request_id)
        beat_every = ticket.lease_ttl_s / 3
        last_beat = time.monotonic()

        def step(piece) -> bool:
            nonlocal last_beat
            remaining(deadline, ticket)
            if time.monotonic() - last_beat > beat_every:
                self._call(conn, ticket, deadline, {"op": "heartbeat"})
                last_beat = time.monotonic()
            shaper.pace(piece.nbytes)
            return faults.hit(piece.offset, piece.nbytes)

        shaper.start()
        copy_pieces(src, flat_bytes(self.pool.kv), pieces, step)
        shaper.finish()
        return total_bytes(pieces)

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        conn = self._connect(ticket, deadline)
        try:
            return bool(conn.call({"op": "heartbeat", "request_id": ticket.request_id})["ok"])
        except (ChannelClosed, OSError):
            return False
        finally:
            conn.close()

    def close(self) -> None:
        self._maps.clear()
