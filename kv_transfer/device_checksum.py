"""`wsum64`: the per-block checksum of device pools, computed where the blocks are.

A host checksum of a GPU pool's block needs the block on the host first: a copy per
block, synchronising the stream it runs on. `wsum64` is torch arithmetic on the
block's own device instead, so only one 64-bit sum per block ever crosses to the host
(one copy per call): the block's bytes read as 32-bit words w[i] (as bytes where its
size is not a multiple of 4), each sign-extended and multiplied by an odd constant of
its position, m[i] = 2 * (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) + 1, all
summed modulo 2^64 (int64 arithmetic wraps). Integer sums do not depend on the order of
addition, so a CPU and every GPU give the same value for the same bytes.

What it catches: any change to one word (m[i] is odd, so a nonzero change times it is
nonzero modulo 2^64), and any two different words swapped (the difference of their
multipliers is twice their distance times an odd constant, and distance times word
difference stays far below 2^63). It is a check against corruption, not against an
adversary, as the host checksums are.

Who calls it: the sender's `export` (the engine thread, between steps: the compute
stream is idle, and reading the sums back confirms the blocks are final before any
transfer reads them) and the receiver's `BlockVerifier.finish` (on the transfer's own
stream, kv_transfer/transfer_stream.py). The ticket names the algorithm.
"""

from __future__ import annotations

import functools

import torch

WSUM64 = "wsum64"
DEVICE_CHECKSUMS = (WSUM64,)
"""Algorithms computed on the pool's device over whole blocks at once (never streamed)."""

_MASK = (1 << 64) - 1
_STEP = 0x9E3779B97F4A7C15 - (1 << 64)  # the same 64 bits as an int64
_OFFSET = 0x632BE59BD9B4E019
GROUP_BYTES = 32 << 20
"""Most bytes of int64 products held at once (a group of blocks per reduction)."""


def checksum_algo_for(device: torch.device, configured: str) -> str:
    """The algorithm a sender checksums its exports with: `configured` (xxh3_64 or crc32,
    computed on the host) for a CPU pool, `wsum64` for a device pool."""
    return configured if device.type == "cpu" else WSUM64


@functools.lru_cache(maxsize=8)
def position_weights(count: int, device: torch.device) -> torch.Tensor:
    """The odd multipliers m[0..count) as int64 on `device` (kept: one per block shape)."""
    positions = torch.arange(count, dtype=torch.int64, device=device)
    return (positions * _STEP + _OFFSET) * 2 + 1


def block_words(kv: torch.Tensor) -> torch.Tensor:
    """The block-major pool as [num_blocks, words]: int32 words, or bytes where a block's
    size is not a multiple of 4."""
    flat = kv.view(kv.shape[0], -1)
    dtype = torch.int32 if flat.shape[1] * flat.element_size() % 4 == 0 else torch.uint8
    return flat.view(dtype)


def wsum64(kv: torch.Tensor, block_ids: list[int]) -> list[int]:
    """`wsum64` of each given block of a block-major pool, as unsigned 64-bit ints, in
    the order given; computed on the pool's device on the current stream."""
    if not block_ids:
        return []
    words = block_words(kv)
    weights = position_weights(words.shape[1], words.device)
    index = torch.as_tensor(block_ids, dtype=torch.long, device=words.device)
    per_group = max(1, GROUP_BYTES // (words.shape[1] * 8))
    sums = []
    for start in range(0, len(block_ids), per_group):
        rows = words.index_select(0, index[start : start + per_group]).to(torch.int64)
        rows.mul_(weights)
        sums.append(rows.sum(dim=1))
    return [value & _MASK for value in torch.cat(sums).tolist()]


def wsum64_reference(data: bytes) -> int:
    """`wsum64` of one block's bytes in plain Python integers: the definition the torch
    version is tested against (slow; tests only)."""
    if len(data) % 4 == 0:
        words = [
            int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)
        ]
    else:
        words = list(data)
    total = 0
    for position, word in enumerate(words):
        weight = ((position * (_STEP & _MASK) + _OFFSET) * 2 + 1) & _MASK
        total = (total + word * weight) & _MASK
    return total
