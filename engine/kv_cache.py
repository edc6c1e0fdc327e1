"""The paged KV pool: one tensor holding every block of every layer.

Layout (block-major, so one block of one request is one contiguous byte range,
which is what the KV transfer layer ships, checksums and copies):

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        index 2: 0 = keys, 1 = values

A sequence's token at position p lives in block `block_table[p // block_size]`,
slot `p % block_size`. Block ids are local to one pool: a transfer reads blocks by
the sender's ids and writes them under the receiver's ids.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_memory import huge_page_tensor
from engine.model_spec import ModelSpec
from engine.parallel.shard import ModelShard, Span


@dataclass(frozen=True)
class KVLayout:
    """Everything a peer must agree on before it can accept our blocks: the bytes'
    shape, and what they mean (the architecture, and which layers' keys were computed
    under a sliding window: the same shapes of another architecture are other KV)."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    architecture: str = ""
    """transformers' class of the model, e.g. Gemma2ForCausalLM."""
    sliding_window: int = 0
    """The widest sliding window of any layer (0: none)."""
    sliding_layers: str = ""
    """Comma-separated indices of the layers that slide (plain text: tickets are JSON)."""
    tp_size: int = 1
    """Ranks of the tensor-parallel worker whose pool this is (1: not split)."""
    tp_rank: int = 0
    kv_head_start: int = 0
    """The model's first KV head this pool holds; it holds `num_kv_heads` from there."""
    total_kv_heads: int = 0
    """The model's KV heads (0: `num_kv_heads`, an unsplit pool)."""

    @property
    def kv_heads(self) -> Span:
        """The model's KV heads this pool holds."""
        return Span(self.kv_head_start, self.num_kv_heads)

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    def same_kv(self, other: KVLayout) -> bool:
        """Whether `other`'s blocks mean the same model's KV as ours, whatever heads
        each holds (what must agree before heads move between pools)."""
        return self.unsplit() == other.unsplit()

    def unsplit(self) -> KVLayout:
        """This layout as a single rank holding every head would have it."""
        return dataclasses.replace(
            self,
            num_kv_heads=self.model_kv_heads,
            tp_size=1,
            tp_rank=0,
            kv_head_start=0,
            total_kv_heads=0,
        )

    # Cached: a KV receiver reads these on every fetch (a frozen dataclass still has a
    # __dict__ for cached_property to fill).
    @functools.cached_property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @functools.cached_property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)

    @functools.cached_property
    def block_nbytes(self) -> int:
        return self.block_numel * getattr(torch, self.dtype).itemsize

    def as_dict(self) -> dict:
        """The fields as a plain dict (what tickets carry); `dataclasses.asdict` deep-copies
        every value, a noticeable share of a 1 MiB transfer."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def for_model(
        cls, spec: ModelSpec, dtype: torch.dtype, block_size: int, shard: ModelShard | None = None
    ) -> KVLayout:
        """The pool layout of `spec` (of a tensor-parallel rank's `shard`: its KV heads)."""
        split = shard is not None and not shard.whole
        return cls(
            model_id=spec.model_id,
            dtype=str(dtype).removeprefix("torch."),
            num_layers=spec.num_layers,
            num_kv_heads=shard.heads.kv.count if split else spec.num_kv_heads,
            head_dim=spec.head_dim,
            block_size=block_size,
            architecture=spec.architecture,
            sliding_window=spec.sliding_window or 0,
            sliding_layers=",".join(map(str, spec.sliding_layers())),
            tp_size=shard.size if split else 1,
            tp_rank=shard.rank if split else 0,
            kv_head_start=shard.heads.kv.start if split else 0,
            total_kv_heads=spec.num_kv_heads if split else 0,
        )


_MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault pages in writable as a write would, leaving their contents."""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def resident_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of a CPU tensor's storage that are in RAM now (`mincore`; None where that
    call is missing). Soaks tell a pool filling in on first touch from a leak by it."""
    nbytes = tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    start = tensor.data_ptr() - tensor.data_ptr() % page
    count = -(-(tensor.data_ptr() + nbytes - start) // page)
    try:
        vector = (ctypes.c_ubyte * count)()
        failed = _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(count * page), vector)
    except (OSError, AttributeError):
        return None
    if failed:
        return None
    return int((np.frombuffer(vector, dtype=np.uint8) & 1).sum()) * page


class KVCachePool:
    """Storage of the paged KV cache; allocation lives in `BlockAllocator`."""

    def __init__(
        self, layout: KVLayout, num_blocks: int, device: str = "cpu", shm_path: str | None = None
    ):
        self.layout = layout
        self.num_blocks = num_blocks
        self.shm_path: str | None = None
        self._prefaulted = 0
        """Bytes from the pool's start that `prefault` has mapped."""
        shape, dtype = (num_blocks, *layout.block_shape), getattr(torch, layout.dtype)
        if torch.device(device).type == "cpu":
            # Attention reads the blocks in place and KV imports copy into them: huge
            # pages (engine/host_memory.py).
            self.kv = huge_page_tensor(shape, dtype)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        if shm_path is not None:
            self.move_to_shared_memory(shm_path)

    def move_to_shared_memory(self, path: str, keep_contents: bool = True) -> None:
        """Re-home the pool in a shared file (e.g. under /dev/shm) that a peer process on
        this node can map; called by the `shm` KV sender at worker start, before any KV is
        written, with `keep_contents=False`: a new file reads as zeros, and copying a
        pool of nothing but zeros into it cost seconds of a worker's restart (every page
        touched twice). Views taken before this call keep pointing at the old storage."""
        if self.kv.device.type != "cpu":
            raise ValueError("only a CPU pool can live in shared memory")
        shared = torch.from_file(path, shared=True, size=self.kv.numel(), dtype=self.kv.dtype).view(
            self.kv.shape
        )
        if keep_contents:
            shared.copy_(self.kv)
        self.kv = shared
        self.shm_path = path
        self._prefaulted = 0

    def prefault(self, max_bytes: int) -> bool:
        """Map the next `max_bytes` of the pool's pages that were never touched, without
        changing what they hold (MADV_POPULATE_WRITE: safe on blocks in use), so that a
        step writing KV there does not take their page faults. The engine loop's
        SCHED_IDLE warming thread calls it in pieces until it returns False; blocks are
        handed out from id 0 up, so the pages come in the order they will be written.
        False once the whole pool is mapped (or where the call is missing: a GPU pool, an
        old kernel)."""
        storage = self.kv.untyped_storage()
        total = storage.nbytes()
        done = self._prefaulted
        if done >= total or self.kv.device.type != "cpu":
            return False
        page = mmap.PAGESIZE
        base = self.kv.data_ptr() - self.kv.data_ptr() % page
        end = min(total, done + max(max_bytes, page))
        length = (end - done + page - 1) // page * page
        failed = _libc().madvise(
            ctypes.c_void_p(base + done), ctypes.c_size_t(length), _MADV_POPULATE_WRITE
        )
        self._prefaulted = total if failed else end
        return not failed and end < total

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def holds_bf16(self) -> int:
        """1 where the pool holds bfloat16, else 0: the native kernels' `kv_bf16` argument."""
        return int(self.kv.dtype == torch.bfloat16)

    def private_resident_bytes(self) -> int:
        """Bytes of the pool in this process's private memory now (0 for a pool in a
        shared file, or on a device): what its first-touch filling adds to private RSS."""
        if self.shm_path is not None or self.kv.device.type != "cpu":
            return 0
        return resident_bytes(self.kv) or 0

    def layer_view(self, layer: int, kind: int) -> torch.Tensor:
        """[num_blocks, block_size, kv_heads, head_dim] strided view of keys (0) or values (1)."""
        return self.kv[:, layer, kind]

    def write_slots(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k, v) -> None:
        """Store new keys/values [T, kv_heads, head_dim] at (block, offset) slots."""
        self.kv[:, layer, 0][blocks, offsets] = k.to(self.kv.dtype)
        self.kv[:, layer, 1][blocks, offsets] = v.to(self.kv.dtype)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the given blocks: [n, num_layers, 2, block_size, kv_heads, head_dim]."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(0, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite the given blocks with `data` shaped like `read_blocks` returns."""
        expected = (len(block_ids), *self.layout.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"block data has shape {tuple(data.shape)}, expected {expected}")
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(0, index, data.to(device=self.kv.device, dtype=self.kv.dtype))
