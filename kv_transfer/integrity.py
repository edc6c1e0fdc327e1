"""Per-block checksums: computed by the sender at export, verified by the receiver.

The sender checksums each exported block once in `export()` and puts the list in the
ticket; the receiver recomputes them over the blocks it wrote, after the bytes landed
and before it reports DONE. Any mismatch fails the whole transfer with CHECKSUM and
names the blocks (the caller frees its destination blocks, as for any failure).

Two algorithms, named in the ticket so both ends agree:
- `crc32`: zlib over the block's bytes (~2 GB/s here).
- `fast` (default): the block read as uint64 words in 4 KiB rows, each row summed
  (wrapping), then crc32 over the row sums. Any changed word changes its row sum and
  rows are position-checked by the crc, so a flipped bit or a misplaced chunk is caught;
  it runs near memory speed, so verification does not dominate a same-node copy.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from kv_transfer.base import ExportTicket, FailureReason, KVTransferError

ROW_WORDS = 512  # 4 KiB rows of uint64


def block_bytes(block: torch.Tensor) -> np.ndarray:
    """The raw bytes of one contiguous block as a uint8 array (no copy on CPU)."""
    return block.view(-1).view(torch.uint8).cpu().numpy()


def checksum(data: np.ndarray, algo: str) -> int:
    """Checksum of one block's bytes (uint8 array)."""
    if algo == "crc32":
        return zlib.crc32(data)
    if algo != "fast":
        raise ValueError(f"unknown checksum {algo!r}")
    whole = data.size - data.size % (8 * ROW_WORDS)
    rows = data[:whole].view(np.uint64).reshape(-1, ROW_WORDS)
    sums = np.add.reduce(rows, axis=1, dtype=np.uint64)
    return zlib.crc32(data[whole:], zlib.crc32(sums))


def block_checksums(kv: torch.Tensor, block_ids: list[int], algo: str) -> list[int]:
    """Checksums of the given blocks of a block-major CPU pool tensor."""
    return [checksum(block_bytes(kv[b]), algo) for b in block_ids]


def verify_blocks(
    kv: torch.Tensor, dst_block_ids: list[int], ticket: ExportTicket, peer: str
) -> None:
    """Receivers call this after writing: raise CHECKSUM naming the blocks that differ."""
    got = block_checksums(kv, dst_block_ids, ticket.checksum_algo)
    bad = [i for i, (a, b) in enumerate(zip(got, ticket.checksums, strict=True)) if a != b]
    if bad:
        raise KVTransferError(
            f"{len(bad)} of {len(dst_block_ids)} blocks failed their checksum "
            f"(positions {bad[:8]})",
            ticket.request_id,
            peer,
            FailureReason.CHECKSUM,
        )
