"""How one request's blocks are cut into pieces that each transport moves in one go.

Both ends compute the same plan from the sender's block ids, the receiver's block ids,
the block size in bytes and the chunk size: the sender reads pieces of its pool, the
receiver writes them into its own, one copy (or one send, one message) per piece. A
piece is a byte range that is contiguous in both pools, because the pool is
block-major: consecutive block ids are consecutive bytes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from typing import NamedTuple

import numpy as np
import torch


class Piece(NamedTuple):
    """`nbytes` that start at `src` in the sender's pool and land at `dst` in ours (a
    tuple: a fetch plans tens of them, and a frozen dataclass costs 1-2 us each)."""

    src: int
    dst: int
    offset: int
    """Position of the piece in the request's byte stream (sum of earlier pieces)."""
    nbytes: int


def flat_bytes(kv: torch.Tensor) -> torch.Tensor:
    """The whole block-major pool as a 1-D uint8 tensor sharing its storage."""
    return kv.view(-1).view(torch.uint8)


class PoolBytes:
    """A pool's bytes as one uint8 tensor and, on a CPU pool, one numpy view of it
    (None on a device), made again only when the pool's storage changes (the shm
    sender re-homes it at start). Kept by each transport side that slices the pool per
    fetch or per piece: three torch calls per slice cost tens of microseconds on a
    fetch's cold cache."""

    def __init__(self) -> None:
        self._of: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, np.ndarray | None] | None = None

    def views(self, kv: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        if self._of is not kv:
            flat = flat_bytes(kv)
            self._views = (flat, flat.numpy() if flat.device.type == "cpu" else None)
            self._of = kv
        return self._views


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both id lists count up by one."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if not src_ids:
        return []
    if _counts_up(src_ids) and _counts_up(dst_ids):  # one run: no loop in Python
        return [(src_ids[0], dst_ids[0], len(src_ids))]
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _counts_up(ids: list[int]) -> bool:
    return ids[-1] - ids[0] == len(ids) - 1 and ids == list(range(ids[0], ids[-1] + 1))


def requested_blocks(
    export_block_ids: list[int], num_wanted: int, first_block: int | None = None
) -> list[int] | None:
    """The sender's blocks a pull for `num_wanted` blocks reads: the export's last ones
    (a receiver whose prefix cache holds the leading blocks asks only for the rest), or,
    for a segment of a streamed export, those from position `first_block` on. None when
    it asks for none, or for blocks the export does not hold (yet)."""
    if first_block is not None:
        if num_wanted <= 0 or first_block < 0:
            return None
        wanted = export_block_ids[first_block : first_block + num_wanted]
        return wanted if len(wanted) == num_wanted else None
    if not 0 < num_wanted <= len(export_block_ids):
        return None
    return export_block_ids[len(export_block_ids) - num_wanted :]


def plan_pieces(
    src_ids: list[int], dst_ids: list[int], block_nbytes: int, chunk_bytes: int
) -> list[Piece]:
    """Cut the transfer into pieces of at most `chunk_bytes`, contiguous on both sides."""
    pieces: list[Piece] = []
    offset = 0
    for src_block, dst_block, count in block_runs(src_ids, dst_ids):
        src, dst, left = src_block * block_nbytes, dst_block * block_nbytes, count * block_nbytes
        while left:
            n = min(left, chunk_bytes)
            pieces.append(Piece(src, dst, offset, n))
            src, dst, offset, left = src + n, dst + n, offset + n, left - n
    return pieces


def total_bytes(pieces: list[Piece]) -> int:
    return sum(p.nbytes for p in pieces)


def _numpy(flat):
    """A CPU pool's bytes as numpy (given as numpy or a CPU tensor); None on a device."""
    if isinstance(flat, np.ndarray):
        return flat
    return None if flat.is_cuda else flat.numpy()


def copy_pieces(
    src_flat: torch.Tensor | np.ndarray,
    dst_flat: torch.Tensor | np.ndarray,
    pieces: list[Piece],
    step,
    verifier,
) -> None:
    """One copy per piece from the sender's pool bytes into ours (same-process memory).

    `step(piece)` runs before each copy (shaping, faults, heartbeats) and returns True
    when the copied bytes must be corrupted (fault injection on the receiving side).
    CPU pools: the verifier copies each piece and checksums it while it is in cache
    (`BlockVerifier.copy_piece`, numpy copies: one plain memcpy, where torch's copy_
    may split it across intra-op threads, which collapses on a busy 2-core machine).
    Device pools: torch copies, and `verifier.landed(end)` follows each piece.
    """
    src_all, dst_all = _numpy(src_flat), _numpy(dst_flat)
    cpu = src_all is not None and dst_all is not None
    if not cpu:
        src_all, dst_all = src_flat, dst_flat
    for piece in pieces:
        corrupt = step(piece)
        dst = dst_all[piece.dst : piece.dst + piece.nbytes]
        src = src_all[piece.src : piece.src + piece.nbytes]
        if cpu:
            verifier.copy_piece(src, dst, piece.offset, corrupt)
            continue
        dst.copy_(src)
        if corrupt:
            dst[0] = 255 - int(dst[0])
        verifier.landed(piece.offset + piece.nbytes)


def copy_pieces_parallel(
    src_flat: torch.Tensor | np.ndarray,
    dst_flat: torch.Tensor | np.ndarray,
    pieces: list[Piece],
    corrupt: set[int],
    check,
    land,
    executor: Executor,
    lanes: int,
    tick=None,
    tick_s: float = 1.0,
) -> None:
    """`copy_pieces` for CPU pools, the pieces split into `lanes` contiguous stripes that
    `executor` copies at once, one task per stripe (a task per piece cost a handoff and
    a GIL round per MiB).

    Each lane runs `check()` before each piece (raises to stop: cancellation, deadline),
    then `land(src, dst, offset, corrupt)` with the piece's uint8 views, which copies it
    and verifies it (`BlockVerifier.copy_piece`; `corrupt` when the piece's index is in
    `corrupt`, receiver-side fault injection). The calling thread copies the first
    stripe itself (`executor` needs `lanes - 1` threads), calling `tick()` between its
    pieces once `tick_s` has passed (lease heartbeats of a long transfer), then waits
    for the others, ticking every `tick_s`. A failing lane stops the others at their
    next piece.
    Returns (or raises) only once no copy is running, so a caller that frees the
    destination blocks on failure never races a copy into them.
    """
    src_all, dst_all = _numpy(src_flat), _numpy(dst_flat)
    failed = threading.Event()
    last_tick = [time.monotonic()]

    def check_and_tick() -> None:  # the calling thread's lane keeps the heartbeats going
        check()
        if tick is not None and time.monotonic() - last_tick[0] >= tick_s:
            tick()
            last_tick[0] = time.monotonic()

    def copy_stripe(indexes: range, check=check) -> None:
        try:
            for i in indexes:
                if failed.is_set():
                    return
                check()
                piece = pieces[i]
                src = src_all[piece.src : piece.src + piece.nbytes]
                dst = dst_all[piece.dst : piece.dst + piece.nbytes]
                land(src, dst, piece.offset, i in corrupt)  # numpy copies release the GIL
        except BaseException:
            failed.set()
            raise

    own, *others = stripes(pieces, lanes)
    futures = [executor.submit(copy_stripe, r) for r in others]
    try:
        # The calling thread copies a stripe itself: one thread handoff fewer per fetch.
        copy_stripe(own, check_and_tick)
        while True:
            _, pending = wait(futures, timeout=tick_s, return_when=FIRST_EXCEPTION)
            if not pending or failed.is_set():
                break
            if tick is not None:
                tick()
    except BaseException:
        failed.set()
        raise
    finally:
        wait(futures)  # no copy may outlive the call
    for future in futures:
        future.result()  # the first lane's error, if any


def stripes(pieces: list[Piece], lanes: int) -> list[range]:
    """At most `lanes` contiguous index ranges of about equal bytes."""
    total = total_bytes(pieces)
    out, start, acc = [], 0, 0
    for i, piece in enumerate(pieces):
        acc += piece.nbytes
        if acc * lanes >= total * (len(out) + 1) and len(out) < lanes - 1:
            out.append(range(start, i + 1))
            start = i + 1
    if start < len(pieces):
        out.append(range(start, len(pieces)))
    return out
