"""`shm`: same-node transfer through the sender's KV pool living in shared memory.

At start the sender re-homes its pool in a file under `shm_dir` (/dev/shm), creates its
export table next to it (`shm_table.py`: which export holds which block, until when)
and starts a control server. Per transfer the receiver:

    1. maps the sender's pool file (once per sender generation, kept),
    2. the first time (per sender generation), sends `begin` on a control connection
       and waits for the reply: the sender checks the cluster token, extends the
       lease and counts the transfer served, or says the export is gone; the reply
       authorizes mapping the sender's export table. After that it sends nothing:
       the table says whether the export still holds the blocks and how long its
       lease runs (less than a third left: one heartbeat first),
    3. copies the blocks itself on `copy_lanes` threads (no socket in the data path),
       each block copied and checksummed in one pass, heartbeating if pacing makes
       the copy outlast a third of the lease,
    4. checks the table again (or reads the `begin` reply, which has long arrived): an
       export released during the copy fails the fetch UNKNOWN_REQUEST, as a refused
       `begin` does, before the checksums are looked at.

Checksums catch any block the sender reused under us. A dead sender's export is not
lost: its pool file outlives it in the receiver's mapping (and in /dev/shm until a
restarted worker on the node clears it), nothing writes those blocks any more, so the
receiver copies them without a `begin` and the checksums decide; a fetch fails
PEER_DIED only when the file is gone too. Each sender generation's files are mapped
once and unmapped when the sender is seen restarted (new files). Faults: drop/stall/
kill strike in the sender's `begin` handler, so a sender configured with one publishes
no table and every fetch sends `begin`; corrupt strikes in the receiver's copy (the
sender never touches these bytes).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from engine.kv_cache import KVCachePool
from kv_transfer.base import ExportTicket, FailureReason, KVTransferError
from kv_transfer.blockio import (
    copy_pieces,
    copy_pieces_parallel,
    plan_pieces,
    total_bytes,
)
from kv_transfer.config import FaultOptions, TransportOptions
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
    Begin,
    Done,
    Follow,
    Heartbeat,
    Reply,
    SegmentNote,
    parse_request,
)
from kv_transfer.endpoints import HostPort, ShmEndpoint, ShmTable
from kv_transfer.faults import DropTransfer, FaultPlan
from kv_transfer.integrity import BlockVerifier
from kv_transfer.push import ExportGone, FollowedSegments
from kv_transfer.receiver import TransportReceiver, fail, remaining
from kv_transfer.sender import RegistrySender
from kv_transfer.shaping import Shaper
from kv_transfer.transports.shm_table import ExportTable, export_tag

logger = logging.getLogger(__name__)

FILE_PREFIX = "pdserve-kv-"
POOL_SUFFIX = ".kv"
TABLE_SUFFIX = ".leases"
SENDER_FAULTS = ("drop", "stall", "kill")
"""Fault modes that strike in the sender's `begin` handler: a sender configured with one
publishes no export table, so that every fetch sends `begin`."""
PIECE_BYTES = 1 << 20
"""Most bytes a copy lane moves between two deadline / cancellation checks."""


def _pid_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_files(shm_dir: str) -> None:
    """Delete the pool files and export tables of senders that died without closing
    (each name ends in its writer's pid)."""
    for path in glob.glob(os.path.join(shm_dir, f"{FILE_PREFIX}*")):
        if path.endswith((POOL_SUFFIX, TABLE_SUFFIX)) and _writer_gone(path):
            _unlink_quietly(path)


def _sender_gone(ticket: ExportTicket) -> bool:
    return _writer_gone(ticket.sender_endpoint.shm.path)


EXIT_GRACE_S = 1.0
"""How long a sender whose control socket is already closed may take to finish exiting:
the kernel closes a dying process's sockets before it turns it into a zombie."""


def _sender_exited(ticket: ExportTicket, deadline: float) -> bool:
    """Whether the sender has exited, waiting out the end of an exit in progress."""
    until = min(deadline, time.monotonic() + EXIT_GRACE_S)
    while not _sender_gone(ticket):
        if time.monotonic() >= until:
            return False
        time.sleep(0.005)
    return True


def _writer_gone(path: str) -> bool:
    """Whether the process that wrote a pool file (its pid ends the name) has exited."""
    pid = _file_pid(path)
    return pid > 0 and not _pid_alive(pid)


def _file_pid(path: str) -> int:
    """The pid a pool or table file's name ends in (`...-<pid>.kv`); -1 when it has none."""
    try:
        return int(os.path.splitext(path)[0].rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def copy_lanes(options: TransportOptions) -> int:
    """Threads a receiver copies with: `copy_threads`, or this process's torch threads."""
    return options.copy_threads or torch.get_num_threads()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ShmServer:
    """Sender half: owns the pool file and answers begin / heartbeat."""

    exports_outlive_process = True
    """The pool file stays readable after this process dies (see the module docstring)."""

    def __init__(self, sender: RegistrySender):
        self.sender = sender
        options = sender.options
        pool = sender.pool
        if pool.kv.device.type != "cpu":
            raise ValueError("the shm transport needs a CPU KV pool; use collective for CUDA")
        self.owns_file = pool.shm_path is None
        safe_id = "".join(c if c.isalnum() else "_" for c in sender.worker_id)
        stem = os.path.join(options.shm_dir, f"{FILE_PREFIX}{safe_id}-{os.getpid()}")
        remove_stale_files(options.shm_dir)
        if self.owns_file:
            pool.move_to_shared_memory(stem + POOL_SUFFIX, keep_contents=False)  # zeros
        self.path = pool.shm_path
        self.faults: FaultOptions = options.faults
        self.table_path = stem + TABLE_SUFFIX
        self.table = ExportTable.create(self.table_path, pool.num_blocks, pool.layout.block_nbytes)
        sender.registry.listen(self.table)
        self.control = ControlServer(options, self._handle, f"kv-shm-{sender.worker_id}")

    def endpoint(self) -> ShmEndpoint:
        pool = self.sender.pool
        table = None
        if self.faults.mode not in SENDER_FAULTS:
            table = ShmTable(self.table_path, pool.num_blocks)
        return ShmEndpoint(
            path=self.path,
            nbytes=pool.kv.numel() * pool.kv.element_size(),
            control=HostPort(self.sender.options.dial_host, self.control.port),
            table=table,
        )

    def _handle(self, conn: socket.socket, message: dict) -> None:
        while True:
            request = parse_request(message)
            if isinstance(request, Begin):
                self._begin(conn, request.request_id, request.nbytes)
            elif isinstance(request, Heartbeat):
                alive = self.sender.heartbeat(request.request_id)
                _reply(conn, Reply(alive, FailureReason.UNKNOWN_REQUEST))
            elif isinstance(request, Follow):
                self._follow(conn, request)
            else:
                _reply(conn, Reply(False, FailureReason.INTERNAL, f"op {request.op}"))
            message = recv_message(conn)

    def _follow(self, conn: socket.socket, request: Follow) -> None:
        """push: announce each run of the export's blocks as it is exported; the receiver
        copies them out of the pool file (no bytes on this connection)."""
        try:
            for note in self.sender.pushed(request.request_id, request.first_block):
                send_message(conn, WAITING if note is None else note.to_json())
        except ExportGone:
            _reply(conn, Reply(False, FailureReason.UNKNOWN_REQUEST, "export is gone"))
            return
        send_message(conn, Done(0).to_json())

    def _begin(self, conn: socket.socket, request_id: str, nbytes: int) -> None:
        plan = FaultPlan(self.faults, 1, request_id)
        try:
            plan.hit(0, 1)  # drop, stall, or kill (this process dies, the reply unsent)
        except DropTransfer:
            conn.shutdown(socket.SHUT_RDWR)
            raise ChannelClosed("dropped by fault injection") from None
        registry = self.sender.registry
        if registry.begin_transfer(request_id) is None:
            _reply(conn, Reply(False, FailureReason.UNKNOWN_REQUEST))
            return
        registry.end_transfer(request_id, nbytes)  # the receiver moves the bytes itself
        _reply(conn, Reply(True))

    def close(self) -> None:
        self.control.close()
        _unlink_quietly(self.table_path)  # the mapping stays valid until the process ends
        if self.owns_file and self.path:
            _unlink_quietly(self.path)


def _reply(conn: socket.socket, reply: Reply) -> None:
    send_message(conn, reply.to_json())


def make_shm_sender(worker_id: str, pool: KVCachePool, options: TransportOptions):
    return RegistrySender("shm", worker_id, pool, options, [ShmServer])


class ShmReceiver(TransportReceiver):
    """Receiver half: maps each sender's pool file once and copies out of it; keeps idle
    control connections per sender so a transfer costs one round trip, not a connect."""

    def __init__(self, worker_id: str, pool: KVCachePool, options: TransportOptions):
        super().__init__("shm", worker_id, pool, options)
        self._maps: dict[str, tuple[str, mmap.mmap, np.ndarray]] = {}
        """sender id -> (pool file, its mapping, the mapping's bytes)."""
        self._tables: dict[str, tuple[str, ExportTable]] = {}
        """sender id -> (export table file, its mapping), once the sender accepted us."""
        self._idle: dict[tuple[str, int], list[ControlConnection]] = {}
        self._idle_lock = threading.Lock()
        self.copy_lanes = copy_lanes(options)
        self._receiver_faults = FaultOptions(  # the sender's faults strike in its `begin`
            mode="corrupt" if options.faults.mode == "corrupt" else "none",
            probability=options.faults.probability,
            after_fraction=options.faults.after_fraction,
        )
        self._copier = (
            ThreadPoolExecutor(self.copy_lanes - 1, thread_name_prefix="kv-shm-copy")
            if self.copy_lanes > 1
            else None
        )

    def _mapped(self, ticket: ExportTicket) -> np.ndarray:
        """The sender's pool bytes, mapped once per sender generation: a restarted sender
        has a new file, and the old mapping is dropped (it alone kept the dead pool's
        pages allocated in /dev/shm after the file was removed)."""
        info = ticket.sender_endpoint.shm
        path, nbytes = info.path, info.nbytes
        cached = self._maps.get(ticket.sender_id)
        if cached is not None and cached[0] == path:
            return cached[2]
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
        flat = np.frombuffer(region, dtype=np.uint8)
        # Unmapped when the last copy still reading it lets go of its view.
        self._maps[ticket.sender_id] = (path, region, flat)
        return flat

    @staticmethod
    def _address(ticket: ExportTicket) -> tuple[str, int]:
        control = ticket.sender_endpoint.shm.control
        return control.host, control.port

    def _checkout(self, ticket: ExportTicket, deadline: float) -> ControlConnection:
        """An idle connection to the ticket's sender, or a new one."""
        with self._idle_lock:
            idle = self._idle.get(self._address(ticket))
            if idle:
                return idle.pop()
        try:
            return ControlConnection(
                *self._address(ticket), self.options, remaining(deadline, ticket)
            )
        except OSError as exc:
            raise fail(ticket, FailureReason.PEER_DIED, f"control unreachable: {exc}") from None

    def _checkin(self, ticket: ExportTicket, conn: ControlConnection) -> None:
        """Keep a connection whose last exchange completed; failed ones are closed."""
        with self._idle_lock:
            self._idle.setdefault(self._address(ticket), []).append(conn)

    def _send(
        self, conn: ControlConnection, ticket: ExportTicket, request: Begin | Heartbeat
    ) -> None:
        try:
            conn.send(request.to_json())
        except OSError as exc:
            raise self._lost(ticket, request.op, exc) from None

    def _reply(
        self, conn: ControlConnection, ticket: ExportTicket, deadline: float, op: str
    ) -> Reply:
        """The reply to the oldest request sent on `conn`, failures mapped to reasons."""
        try:
            reply = Reply.from_json(conn.recv(remaining(deadline, ticket)))
        except TimeoutError:
            raise fail(ticket, FailureReason.TIMEOUT, f"sender silent on {op}") from None
        except (ChannelClosed, OSError) as exc:
            raise self._lost(ticket, op, exc) from None
        if not reply.ok:
            raise fail(ticket, reply.failure, f"sender refused {op}: {reply.to_json()}")
        return reply

    def _lost(self, ticket: ExportTicket, op: str, exc: Exception) -> KVTransferError:
        host, port = self._address(ticket)
        reason = (
            FailureReason.DROPPED
            if responsive(host, port, self.options)
            else FailureReason.PEER_DIED
        )
        return fail(ticket, reason, f"control channel lost on {op}: {exc}")

    def _call(self, conn, ticket, deadline: float, request: Begin | Heartbeat) -> Reply:
        """One control round trip."""
        self._send(conn, ticket, request)
        return self._reply(conn, ticket, deadline, request.op)

    def _pull(
        self,
        ticket: ExportTicket,
        dst_block_ids: list[int],
        deadline: float,
        verifier: BlockVerifier,
    ) -> str:
        if ticket.sender_endpoint.shm is None:
            raise fail(ticket, FailureReason.INTERNAL, "sender does not serve shm")
        src = self._mapped(ticket)
        try:
            table = self._table(ticket)
            if table is None:
                self._pull_granted(ticket, src, dst_block_ids, deadline, verifier)
                self._open_table(ticket)
            else:
                self._pull_leased(ticket, table, src, dst_block_ids, deadline, verifier)
        except KVTransferError as exc:
            if exc.reason != FailureReason.PEER_DIED or not _sender_exited(ticket, deadline):
                raise
            # The sender died after its export, but its pool file outlives it in our
            # mapping and nothing writes those blocks any more: copy them again from the
            # start, and let the checksums say whether they are still the export's.
            logger.info(
                "[request %s] %s died; copying from its pool file",
                ticket.request_id,
                ticket.sender_id,
            )
            verifier.restart()
            self._copy(ticket, src, dst_block_ids, deadline, verifier, beat=None)
        return "shm"

    def _table(self, ticket: ExportTicket) -> ExportTable | None:
        """The export table of the ticket's sender generation, once that sender has
        accepted us (`_open_table`); None before, and for senders that publish none."""
        info = ticket.sender_endpoint.shm.table
        cached = self._tables.get(ticket.sender_id)
        if info is None or cached is None or cached[0] != info.path:
            return None
        return cached[1]

    def _open_table(self, ticket: ExportTicket) -> None:
        """Map the sender's export table after a `begin` it answered (token checked), so
        that the next fetches from this sender generation read their lease there."""
        info = ticket.sender_endpoint.shm.table
        if info is None or self._table(ticket) is not None:
            return
        table = ExportTable.open(info.path, info.blocks, self.pool.layout.block_nbytes)
        if table is None:
            return
        # A restarted sender's predecessor is unmapped once no fetch still reads it.
        self._tables[ticket.sender_id] = (info.path, table)

    def _pull_leased(self, ticket, table: ExportTable, src, dst_block_ids, deadline, verifier):
        """The copy with no control message: the export's tags in the sender's table say
        it still holds the blocks, before the copy and after it (its tags are cleared
        before its blocks can be reused). A lease with less than a third of its time left
        is extended first, as a long copy's heartbeats do."""
        tag = export_tag(ticket.request_id)
        left = table.lease_left_s(ticket.block_ids, tag)
        if left is None:
            raise fail(ticket, FailureReason.UNKNOWN_REQUEST, "export already released")
        conn: ControlConnection | None = None

        def beat() -> None:
            nonlocal conn
            if conn is None:
                conn = self._checkout(ticket, deadline)
            self._call(conn, ticket, deadline, Heartbeat(ticket.request_id))

        try:
            if left < ticket.lease_ttl_s / 3:
                beat()
            self._copy(ticket, src, dst_block_ids, deadline, verifier, beat)
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        if conn is not None:
            conn.accepted = True
            self._checkin(ticket, conn)
        if not table.holds(ticket.block_ids, tag):
            raise fail(ticket, FailureReason.UNKNOWN_REQUEST, "export released during the copy")
        table.mark_copied(ticket.block_ids)

    def _pull_granted(self, ticket, src: np.ndarray, dst_block_ids, deadline, verifier) -> None:
        """`begin`, then the copy (overlapping the reply on an accepted connection)."""
        conn = self._checkout(ticket, deadline)
        try:
            # On a connection the sender already accepted (token checked), the `begin`
            # reply is read after the copy, so the round trip overlaps the copy: the
            # bytes land in our own blocks, and a refused begin still fails the fetch.
            # A new connection waits for it: nothing is read before the token is.
            nbytes = len(dst_block_ids) * self.pool.layout.block_nbytes
            self._send(conn, ticket, Begin(nbytes, ticket.request_id))
            begun = [False]

            def confirm_begin() -> None:
                if not begun[0]:
                    self._reply(conn, ticket, deadline, "begin")
                    begun[0] = True

            def beat() -> None:
                confirm_begin()  # the begin reply comes first on this connection
                self._call(conn, ticket, deadline, Heartbeat(ticket.request_id))

            if not conn.accepted:
                confirm_begin()

            self._copy(ticket, src, dst_block_ids, deadline, verifier, beat)
            confirm_begin()
        except BaseException:
            conn.close()
            raise
        conn.accepted = True
        self._checkin(ticket, conn)

    def _copy(self, ticket, src: np.ndarray, dst_block_ids, deadline: float, verifier, beat):
        """Copy the ticket's blocks on the copy lanes, checksummed on the way, calling
        `beat()` (a lease heartbeat) every third of the lease; None: a dead sender's
        export, whose lease no heartbeat can extend."""
        shaper = Shaper(self.options.bandwidth_bytes_per_s, self.options.added_latency_s)
        block = self.pool.layout.block_nbytes
        # Pieces of whole blocks, so that the verifier sums each block in L2-sized steps
        # right behind their copies (a piece cutting a block is summed after the copy).
        chunk = min(shaper.piece_bytes(self.options.chunk_bytes), PIECE_BYTES)
        chunk = max(block, chunk // block * block)
        pieces = plan_pieces(ticket.block_ids, dst_block_ids, block, chunk)
        faults = FaultPlan(self._receiver_faults, total_bytes(pieces), ticket.request_id)
        beat_every = ticket.lease_ttl_s / 3 if beat is not None else float("inf")
        last_beat = time.monotonic()

        def tick() -> None:
            nonlocal last_beat
            beat()
            last_beat = time.monotonic()

        def step(piece) -> bool:
            remaining(deadline, ticket)
            if time.monotonic() - last_beat > beat_every:
                tick()
            shaper.pace(piece.nbytes)
            return faults.hit(piece.offset, piece.nbytes)

        shaper.start()
        dst = self._pool_bytes()  # numpy views: copies that release the GIL, no torch per call
        # A paced link gains nothing from lanes; one piece is not worth a thread handoff.
        if self._copier is None or shaper.active or len(pieces) < 2:
            copy_pieces(src, dst, pieces, step, verifier)
        else:
            corrupt = set()
            if faults.armed:
                corrupt = {i for i, p in enumerate(pieces) if faults.hit(p.offset, p.nbytes)}
            copy_pieces_parallel(
                src,
                dst,
                pieces,
                corrupt,
                lambda: remaining(deadline, ticket),
                verifier.copy_piece,
                self._copier,
                self.copy_lanes,
                tick=tick if beat is not None else None,
                tick_s=beat_every if beat is not None else 1.0,
            )
        shaper.finish()

    def _follow(self, followed: FollowedSegments, timeout_s: float) -> str:
        ticket = followed.ticket
        if ticket.sender_endpoint.shm is None:
            raise fail(ticket, FailureReason.INTERNAL, "sender does not serve shm")
        src = self._mapped(ticket)
        conn = self._checkout(ticket, time.monotonic() + timeout_s)
        try:
            self._send(conn, ticket, Follow(ticket.request_id, followed.first_block, []))
            while True:
                message = self._next_note(conn, ticket, timeout_s)
                if message is None:
                    break  # done: the export is complete
                segment, dst, verifier, arrived = followed.open(message)
                deadline = time.monotonic() + timeout_s
                self._copy(segment, src, dst, deadline, verifier, beat=None)
                followed.landed(segment, verifier, arrived)
        except BaseException:
            conn.close()
            raise
        conn.accepted = True
        self._checkin(ticket, conn)
        followed.ended()
        return "shm"

    def _next_note(self, conn: ControlConnection, ticket, timeout_s: float) -> SegmentNote | None:
        """The next segment of a standing transfer (None: it ended), through its sender's
        `Waiting` notes (each gives the sender `timeout_s` more), failing at once on a
        cancel or a refusal."""
        while True:
            deadline = time.monotonic() + timeout_s
            try:
                message = conn.recv(remaining(deadline, ticket))
            except TimeoutError:
                raise fail(ticket, FailureReason.TIMEOUT, "sender silent on follow") from None
            except (ChannelClosed, OSError) as exc:
                raise self._lost(ticket, "follow", exc) from None
            remaining(deadline, ticket)  # cancelled meanwhile?
            note = SegmentNote.from_json(message)
            if note is not None:
                return note
            if Done.from_json(message) is not None:
                return None
            if not message.get("waiting"):
                reply = Reply.from_json(message)
                raise fail(ticket, reply.failure, f"sender refused follow: {message}")

    def keepalive(self, ticket: ExportTicket, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        try:
            conn = self._checkout(ticket, deadline)
        except KVTransferError:
            return self._outlived(ticket)
        try:
            reply = Reply.from_json(conn.call(Heartbeat(ticket.request_id).to_json(), timeout_s))
        except (ChannelClosed, OSError):
            conn.close()
            return self._outlived(ticket)
        if reply.reason == FailureReason.UNAUTHORIZED:  # the sender closed this connection
            conn.close()
            return False
        conn.accepted = True
        self._checkin(ticket, conn)
        return reply.ok

    def _outlived(self, ticket: ExportTicket) -> bool:
        """A dead sender's export is still there when we hold a mapping of its pool file
        (the file may be gone: the mapping keeps the pages), so an import waiting for
        blocks need not give up on it; a later fetch copies it and verifies."""
        cached = self._maps.get(ticket.sender_id)
        path = ticket.sender_endpoint.shm.path
        return cached is not None and cached[0] == path and _sender_gone(ticket)

    def close(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        self._maps.clear()
        for _, table in self._tables.values():
            table.close()
        self._tables.clear()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
