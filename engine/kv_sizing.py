"""How many KV blocks fit a share of the device's memory (`gpu_memory_utilization`).

vLLM's meaning: an engine may take `fraction` of the device's total memory for all it
holds; what its weights, the activations of its largest step, its CUDA graphs and the
runtime's own memory leave of that share is the KV pool. `LLMEngine` on CUDA, given
no block count, measures those (engine/memory_profile.py) and calls `size_kv_pool`
before it allocates the pool; the numbers here are plain ints, so the arithmetic and
its refusals are tested on a CPU with made-up devices.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


class KVMemoryError(ValueError):
    """The configured share of device memory cannot hold the KV of one sequence of
    `max_model_len` tokens (or the device no longer has that memory free)."""


@dataclass(frozen=True)
class KVSizing:
    """What `size_kv_pool` decided, and what the engine logs about it."""

    num_blocks: int
    """Blocks in the pool, the CUDA graphs' scratch block included."""
    scratch_blocks: int
    block_size: int
    block_bytes: int
    blocks_per_seq: int
    """Blocks of one sequence of `max_model_len` tokens."""
    max_model_len: int
    total_bytes: int
    used_bytes: int
    """The engine's memory besides the pool (weights, activation peak, graphs, runtime)."""
    fraction: float

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - self.scratch_blocks

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the allocator can hand out."""
        return self.usable_blocks * self.block_size

    @property
    def max_concurrency(self) -> int:
        """Sequences of `max_model_len` tokens that fit the pool at once."""
        return self.usable_blocks // self.blocks_per_seq

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        """The start-up log line: the pool, what it holds, and where the numbers came from."""
        return (
            f"KV pool: {self.num_blocks} blocks ({self.pool_bytes / GIB:.2f} GiB, "
            f"{self.kv_tokens} tokens of KV), at most {self.max_concurrency} concurrent "
            f"sequences of {self.max_model_len} tokens; gpu_memory_utilization "
            f"{self.fraction:g} of {self.total_bytes / GIB:.2f} GiB, "
            f"{self.used_bytes / GIB:.2f} GiB for weights, activations, graphs and runtime"
        )


def size_kv_pool(
    total_bytes: int,
    used_bytes: int,
    fraction: float,
    block_bytes: int,
    *,
    block_size: int,
    max_model_len: int,
    scratch_blocks: int = 0,
    free_bytes: int | None = None,
) -> KVSizing:
    """The pool that `fraction` of a device of `total_bytes` holds once the engine's
    other memory (`used_bytes`) is taken out, in whole blocks of `block_bytes`.

    Raises `KVMemoryError` when that is less than one `max_model_len` sequence plus the
    scratch, naming the numbers and the smallest fraction that would do, or when the
    pool would not fit `free_bytes`, what the device has free for it now (another
    process holds the rest)."""
    if not 0 < fraction <= 1:
        raise KVMemoryError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
    kv_bytes = max(0, int(total_bytes * fraction) - used_bytes)
    blocks = kv_bytes // block_bytes
    per_seq = -(-max_model_len // block_size)
    needed = per_seq + scratch_blocks
    if blocks < needed:
        least = (used_bytes + needed * block_bytes) / total_bytes
        raise KVMemoryError(
            f"gpu_memory_utilization {fraction:g} of {total_bytes / GIB:.2f} GiB leaves "
            f"{kv_bytes / GIB:.3f} GiB for the KV pool after {used_bytes / GIB:.3f} GiB of "
            f"weights, activations, graphs and runtime; one {max_model_len}-token sequence "
            f"needs {needed} blocks of {block_bytes} bytes ({needed * block_bytes / GIB:.3f} "
            f"GiB). Raise gpu_memory_utilization to at least {least:.3f}, lower "
            "max_model_len, or set num_kv_blocks"
        )
    if free_bytes is not None and blocks * block_bytes > free_bytes:
        raise KVMemoryError(
            f"a KV pool of {blocks} blocks ({blocks * block_bytes / GIB:.2f} GiB, "
            f"gpu_memory_utilization {fraction:g}) does not fit the {free_bytes / GIB:.2f} "
            "GiB the device has free for it: another process or engine holds the rest. "
            "Lower gpu_memory_utilization or set num_kv_blocks"
        )
    return KVSizing(
        num_blocks=blocks,
        scratch_blocks=scratch_blocks,
        block_size=block_size,
        block_bytes=block_bytes,
        blocks_per_seq=per_seq,
        max_model_len=max_model_len,
        total_bytes=total_bytes,
        used_bytes=used_bytes,
        fraction=fraction,
    )
