"""Per-block checksums: computed by the sender at export, verified by the receiver.

The sender checksums each exported block once in `export()` and puts the list in the
ticket; the receiver recomputes them over the blocks it wrote before it reports DONE.
Transports feed a `BlockVerifier` as bytes land (`landed`), so each block is summed
while it is still in cache (and, for collective, while the next piece is in flight);
`finish` sums whatever was not fed. Copying transports (shm, local, gRPC on CPU pools)
let it do the copy (`copy_piece`): where the native kernels are built, each whole
block is copied and hashed in one pass (engine/native/checksum.c: xxHash's XXH3 reads
each 2 KiB step from L1 right behind its copy, so verifying costs no extra pass over
memory); elsewhere, and for a block a piece cuts, in L2-sized steps, every step summed
right behind its copy, so the sum reads the bytes from L2 instead of memory. Any
mismatch fails the whole transfer with CHECKSUM and names the blocks (the caller frees
its destination blocks, as for any failure).

Three algorithms, named in the ticket so both ends agree:
- `xxh3_64` (default on CPU pools): XXH3 from the `xxhash` library, 64 bits over the
  block's bytes. It runs at tens of GB/s on one core with the GIL released, so on a
  2-core box the verification thread takes a small share of a core from the
  transport's own threads.
- `crc32`: zlib over the block's bytes (~3 GB/s here), for peers without xxhash.
- `wsum64` (always on device pools, kv_transfer/device_checksum.py): a position-weighted
  64-bit sum computed on the pool's device, every block of a fetch in one go at
  `finish` (the receiver's transfer stream), so no block is copied to the host to be
  verified. The receipt (`TransferResult.checksum`) names the algorithm that verified.
"""

from __future__ import annotations

import functools
import math
import zlib

import numpy as np
import torch
import xxhash

from kv_transfer.base import ExportTicket, FailureReason, KVTransferError
from kv_transfer.blockio import flat_bytes
from kv_transfer.device_checksum import DEVICE_CHECKSUMS, wsum64


def block_bytes(block: torch.Tensor) -> np.ndarray:
    """The raw bytes of one contiguous block as a uint8 array (no copy on CPU)."""
    return block.view(-1).view(torch.uint8).cpu().numpy()


def checksum(data: np.ndarray, algo: str) -> int:
    """Checksum of one block's bytes (a contiguous uint8 array)."""
    if algo == "xxh3_64":
        return xxhash.xxh3_64_intdigest(data)
    if algo == "crc32":
        return zlib.crc32(data)
    raise ValueError(f"unknown checksum {algo!r}")


CACHE_STEP = 1 << 20
"""Bytes copied, then summed, at a time by `copy_piece`: what was just written is still
in one core's L2 (1-2 MiB on the CPUs we run on). Smaller steps lose more to handing
the GIL between copy lanes than they gain in cache hits."""


@functools.cache
def _fused_copy_hash():
    """The native XXH3-64 copy-and-hash of whole blocks (xxHash's code, fused with the
    copy in engine/native/checksum.c), or None where the kernels cannot be built (no
    compiler): then `copy_piece` copies and hashes in steps."""
    from engine.native.ops import native_kernels  # not at import: it may compile

    kernels = native_kernels()
    return None if kernels is None else kernels.copy_xxh3_blocks


class _Crc32Stream:
    """zlib.crc32 with the interface of xxhash's streaming hashers."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def streaming_checksum(algo: str):
    """A hasher fed piece by piece whose `intdigest()` equals `checksum` of the whole;
    None for the device algorithms, which sum whole blocks at `finish`."""
    if algo in DEVICE_CHECKSUMS:
        return None
    if algo == "xxh3_64":
        return xxhash.xxh3_64()
    if algo == "crc32":
        return _Crc32Stream()
    raise ValueError(f"unknown checksum {algo!r}")


def block_checksums(kv: torch.Tensor, block_ids: list[int], algo: str) -> list[int]:
    """Checksums of the given blocks of a block-major pool tensor: the device algorithms
    on the pool's device, the others on the host (a copy per block off a device)."""
    if algo in DEVICE_CHECKSUMS:
        return wsum64(kv, block_ids)
    return [checksum(block_bytes(kv[b]), algo) for b in block_ids]


class BlockVerifier:
    """Checks one fetch's destination blocks against the ticket.

    The receiver makes one per fetch. A transport that receives into our blocks itself
    (collective, device pools) calls `landed(end)` once the request's byte stream is
    complete up to `end` (blocks are verified as soon as they are whole); one that
    copies on the CPU has it copy each piece (`copy_piece`), in any order for pieces
    of whole blocks. The receiver calls `finish()` after the transport returns.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        dst_block_ids: list[int],
        ticket: ExportTicket,
        flat: np.ndarray | None = None,
        block_nbytes: int | None = None,
    ):
        if len(ticket.checksums) != len(dst_block_ids):
            raise KVTransferError(
                f"{len(ticket.checksums)} checksums for {len(dst_block_ids)} blocks",
                ticket.request_id,
                ticket.sender_id,
                FailureReason.INTERNAL,
            )
        self.kv = kv
        # CPU pools: one numpy view of the pool, sliced per block (torch indexing per
        # block costs as much as summing a small block).
        # `flat`: that view made once by the caller (it costs as much as a small fetch);
        # `block_nbytes`: the caller's layout's, where it has one (torch's shape calls
        # cost tens of microseconds on a fetch's cold cache).
        if flat is None and kv.device.type == "cpu":
            flat = flat_bytes(kv).numpy()
        self.flat = flat
        self.dst = dst_block_ids
        self.ticket = ticket
        if block_nbytes is None:
            block_nbytes = math.prod(kv.shape[1:]) * kv.element_size() if len(kv) else 1
        self.block_nbytes = block_nbytes
        self.done = 0  # stream positions up to here are verified
        self.checked = [False] * len(dst_block_ids)
        self.bad: list[int] = []
        self._partial: dict[int, object] = {}
        """Running sums of blocks `copy_piece` has copied only the head of."""

    def restart(self) -> None:
        """Forget what was verified: the transport copies every piece again."""
        self.done = 0
        self.checked = [False] * len(self.dst)
        self.bad = []
        self._partial = {}

    def landed(self, end: int) -> None:
        """Bytes [0, end) of the stream are in place: verify the blocks now whole (a
        device algorithm waits for `finish`, which sums every block in one go)."""
        if self.ticket.checksum_algo in DEVICE_CHECKSUMS and end < self.stream_nbytes:
            return
        whole = min(end // self.block_nbytes, len(self.dst))
        self.verify_blocks(self.done, whole)
        self.done = max(self.done, whole)

    def copy_piece(self, src: np.ndarray, dst: np.ndarray, offset: int, corrupt: bool) -> None:
        """Copy one piece of the stream (`src` -> `dst`, uint8 views, `dst` in our pool,
        at stream `offset`) and checksum it on the way: each whole block in one native
        pass (`_copy_whole_blocks`), else a `CACHE_STEP` at a time, so the sum reads
        what the copy just wrote, from L2. A
        block cut by the piece's end keeps its running sum for the piece that carries
        the rest, which must come next in stream order (pieces of whole blocks may come
        in any order, from several threads). `corrupt` flips the piece's first byte
        after it is copied (receiver-side fault injection)."""
        at = 0 if corrupt else self._copy_whole_blocks(src, dst, offset)
        if at < len(src):
            self._copy_in_steps(src[at:], dst[at:], offset + at, corrupt)

    def _copy_whole_blocks(self, src: np.ndarray, dst: np.ndarray, offset: int) -> int:
        """Copy and hash, in one native pass each, the whole blocks the piece begins
        with; returns the bytes done (0 where the native path does not apply)."""
        size = self.block_nbytes
        first, within = divmod(offset, size)
        count = min(len(src) // size, len(self.dst) - first)
        if within or count <= 0 or self.ticket.checksum_algo != "xxh3_64":
            return 0
        copy_hash = _fused_copy_hash()
        if copy_hash is None:
            return 0
        digests = np.empty(count, dtype=np.uint64)
        copy_hash(
            src=src.ctypes.data,
            dst=dst.ctypes.data,
            block_nbytes=size,
            count=count,
            out=digests.ctypes.data,
        )
        for i, digest in enumerate(digests.tolist()):
            self._check(first + i, digest)
        return count * size

    def _copy_in_steps(self, src: np.ndarray, dst: np.ndarray, offset: int, corrupt: bool):
        """`copy_piece` in Python: `CACHE_STEP` copies, each hashed right behind."""
        size, step = self.block_nbytes, min(self.block_nbytes, CACHE_STEP)
        at, total = 0, len(src)
        while at < total:
            position, within = divmod(offset + at, size)
            block_end = min(total, at + size - within)
            hasher = self._partial.pop(position, None) if within else None
            if hasher is None and not within and position < len(self.dst):
                hasher = streaming_checksum(self.ticket.checksum_algo)
            while at < block_end:  # no hasher: a block begun out of order, for `finish`
                stop = min(at + step, block_end)
                part = dst[at:stop]
                part[:] = src[at:stop]
                if corrupt and at == 0:
                    part[0] = 255 - int(part[0])
                if hasher is not None:
                    hasher.update(part)
                at = stop
            if hasher is None:
                continue
            if (offset + at) % size:
                self._partial[position] = hasher
            else:
                self._check(position, hasher.intdigest())

    def _check(self, position: int, digest: int) -> None:
        if self.checked[position]:
            return
        if digest != self.ticket.checksums[position]:
            self.bad.append(position)
        self.checked[position] = True

    @property
    def stream_nbytes(self) -> int:
        return len(self.dst) * self.block_nbytes

    def verify_blocks(self, first: int, stop: int) -> None:
        """Check stream positions [first, stop) not checked yet."""
        algo, size = self.ticket.checksum_algo, self.block_nbytes
        if algo in DEVICE_CHECKSUMS:
            positions = [i for i in range(first, stop) if not self.checked[i]]
            digests = wsum64(self.kv, [self.dst[i] for i in positions])
            for i, digest in zip(positions, digests, strict=True):
                self._check(i, digest)
            return
        for i in range(first, stop):
            if self.checked[i]:
                continue
            if self.flat is None:
                data = block_bytes(self.kv[self.dst[i]])
            else:
                data = self.flat[self.dst[i] * size : (self.dst[i] + 1) * size]
            self._check(i, checksum(data, algo))

    def finish(self) -> None:
        """Verify the rest; raise CHECKSUM naming every block position that differs."""
        self.landed(self.stream_nbytes)
        if self.bad:
            raise KVTransferError(
                f"{len(self.bad)} of {len(self.dst)} blocks failed their checksum "
                f"(positions {sorted(self.bad)[:8]})",
                self.ticket.request_id,
                self.ticket.sender_id,
                FailureReason.CHECKSUM,
            )
