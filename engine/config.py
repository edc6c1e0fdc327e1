"""Engine configuration: which model, how big the KV pool is and how work is batched.

`ModelSettings` holds the knobs every engine of a cluster shares; `EngineConfig` adds
what differs per worker (device, pool size, threads), and the cluster's config
inherits `ModelSettings` too, so each of these fields is declared exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.platform import auto_dtype

DType = Literal["auto", "float32", "bfloat16", "float16"]

Kernels = Literal["auto", "native", "torch"]
AttentionBackendName = Literal[
    "auto", "triton", "flashinfer", "flash_attn", "torch", "native", "flash"
]
KVCacheDType = Literal["auto", "float32", "bfloat16"]

# Names only: importing torch here would make every CLI start pay for it.
TORCH_DTYPES = ("float32", "bfloat16", "float16")
KERNEL_CHOICES = ("auto", "native", "torch")
ATTENTION_CHOICES = ("auto", "triton", "flashinfer", "flash_attn", "torch", "native", "flash")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
CPU_KV_BLOCKS = 1024
"""KV blocks of a CPU engine given no count (CPU memory is not profiled)."""


@dataclass(frozen=True)
class ModelSettings:
    """The model and its batching limits, the same on every worker of a cluster."""

    model: str = "demo"
    """`demo` (SmolLM2-135M-Instruct) or a local HF model directory."""
    dtype: DType = "auto"
    """Weights dtype (and the KV's unless `kv_cache_dtype` says otherwise); `auto` is
    bfloat16/float16 on GPUs and float32 on CPUs."""
    kv_cache_dtype: KVCacheDType = "auto"
    """KV cache dtype; `auto` is the model's `dtype`: a bfloat16 model keeps bf16 KV even
    where the native CPU kernels compute in float32 (half the bytes decode attention
    reads and transfers move); `float32` there keeps full-precision KV."""
    block_size: int = 16
    """Tokens per KV block (the same on both pools: blocks move between them)."""
    max_num_seqs: int = 64
    """Most sequences in one engine step (the decode batch)."""
    max_batch_tokens: int = 2048
    """Most tokens (prefill pieces plus decode tokens) in one engine step."""
    prefill_chunk_size: int = 512
    """Longest prefill piece of one prompt per step; longer prompts are chunked."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's context window."""
    kernels: Kernels = "auto"
    """Layer ops: `native` float32 CPU kernels (compiled once, cached), `torch`, or `auto`
    (native where it applies)."""
    attention_backend: AttentionBackendName = "auto"
    """Paged attention: `triton` (the GPU kernels, in place at any block size; on a CPU
    under TRITON_INTERPRET=1, a slow debug mode), `flashinfer` or `flash_attn` (alias
    `flash`; CUDA, where importable, Triton for the rest), `native` (float32 CPU),
    `torch` (dense gather, the reference), or `auto` (CUDA: FlashInfer or flash-attn where
    they serve the block size, else triton; CPU: native, else torch)."""
    cuda_graphs: bool = True
    """Replay CUDA graphs for decode steps, captured at start-up for every batch bucket up
    to `max_num_seqs` (CUDA devices only; ignored on CPU). Reserves one KV block as their
    scratch."""
    prefix_caching: bool = True
    """Reuse the KV of full blocks a previous request already computed for the same prefix
    (`--no-prefix-caching` turns it off: every prompt is computed and moved whole)."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory one engine may take (vLLM's meaning): after its weights
    load and a profiling forward at the largest step (and its CUDA graphs), the KV pool
    gets the rest of that share. Sizes the pool of a CUDA engine given no block count;
    an explicit count (`num_kv_blocks`, a cluster's pool counts) overrides it. Two
    engines on one GPU take a share each (0.45 + 0.45)."""
    deterministic: bool = False
    """Batch-invariant kernels: a row's logits (and its KV) get the same bits whatever the
    batch it runs in, the chunking of its prefill, its prefix-cache hits and the worker,
    so seeded sampling is exact across batches and after a stream migrates. CPU: the
    native kernels (projections on one summation order at every batch size, decode
    attention in a prefill row's arithmetic); GPU: Triton attention without split keys
    and Triton projections and norms of fixed tiles (docs/architecture.md)."""

    def __post_init__(self) -> None:
        _check_choice("kernels", self.kernels, KERNEL_CHOICES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_CHOICES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        share = self.gpu_memory_utilization
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {share!r}")
        for name in ("cuda_graphs", "prefix_caching", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.dtype != "auto" and self.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(TORCH_DTYPES)}, got {self.dtype!r}"
            )
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_batch_tokens": self.max_batch_tokens,
            "prefill_chunk_size": self.prefill_chunk_size,
        }
        for name, value in positive.items():
            _check_positive(name, value)
        if self.prefill_chunk_size > self.max_batch_tokens:
            raise ValueError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) must not exceed "
                f"max_batch_tokens ({self.max_batch_tokens})"
            )
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)


@dataclass(frozen=True)
class EngineConfig(ModelSettings):
    """Sizing and batching knobs of one engine instance (one worker)."""

    device: str = "cpu"
    """Torch device for weights and KV (`cpu`, `cuda`, `cuda:1`)."""
    num_kv_blocks: int | None = None
    """Blocks in the KV pool (capacity = num_kv_blocks * block_size tokens). None: sized
    from the device on CUDA (`gpu_memory_utilization`), `CPU_KV_BLOCKS` on a CPU."""
    num_threads: int | None = None
    """torch intra-op threads for this engine; None leaves torch's default."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_blocks is not None:
            _check_positive("num_kv_blocks", self.num_kv_blocks)
            if self.num_kv_blocks <= self.scratch_blocks:
                raise ValueError(
                    f"num_kv_blocks ({self.num_kv_blocks}) must exceed the "
                    f"{self.scratch_blocks} scratch block the CUDA graphs reserve"
                )
        if self.num_threads is not None:
            _check_positive("num_threads", self.num_threads)

    @property
    def scratch_blocks(self) -> int:
        """KV blocks the engine keeps out of allocation: one where decode CUDA graphs are
        captured (their warm-up and padding rows write only there), else none."""
        return int(self.cuda_graphs and self.device.startswith("cuda"))

    @property
    def sizes_kv_from_device(self) -> bool:
        """Whether the engine sizes its pool from device memory: a CUDA engine given no
        block count."""
        return self.num_kv_blocks is None and self.device.startswith("cuda")

    @property
    def fixed_kv_blocks(self) -> int | None:
        """The pool's block count where the config fixes it (`num_kv_blocks`, or a CPU
        engine's default); None where the engine sizes it from the device."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return None if self.sizes_kv_from_device else CPU_KV_BLOCKS

    @property
    def usable_kv_blocks(self) -> int | None:
        """Blocks the allocator hands out: the pool less its scratch (None until a pool
        sized from the device is built: `LLMEngine.allocator.num_blocks` has it)."""
        blocks = self.fixed_kv_blocks
        return None if blocks is None else blocks - self.scratch_blocks

    @property
    def resolved_dtype(self) -> str:
        return auto_dtype(self.device) if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.resolved_dtype)

    @property
    def kv_torch_dtype(self):
        import torch

        auto = self.kv_cache_dtype == "auto"
        return getattr(torch, self.resolved_dtype if auto else self.kv_cache_dtype)


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
