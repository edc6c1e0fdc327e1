"""Hardware profiles for the roofline: peak dense FLOP/s per dtype and memory bandwidth.

Accelerators come from a small built-in table (vendor datasheet figures, cited per
entry). The `cpu` profile is measured on the spot, in this process: read bandwidth
(a sum over a tensor far larger than the caches) and square-matmul FLOP/s per dtype
with torch's threads. Measured figures are what this machine reaches through torch,
which is the ceiling our engine can hope for here, not a vendor peak.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field

TFLOPS = 1e12
TB_S = 1e12
GIB = 1 << 30


@dataclass(frozen=True)
class HardwareProfile:
    """What one device can do at best; `peak_flops` maps a dtype name to dense FLOP/s."""

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    """Bytes per second read from device memory (HBM, GDDR, or DRAM for `cpu`)."""
    memory_bytes: int
    source: str
    measured: bool = False
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.memory_bandwidth <= 0 or not self.peak_flops:
            raise ValueError(f"{self.name}: needs a bandwidth and at least one FLOP/s figure")

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(
                f"{self.name} has no {dtype} FLOP/s figure; known: {sorted(self.peak_flops)}"
            )
        return self.peak_flops[dtype]

    def ridge(self, dtype: str) -> float:
        """FLOPs per byte at which compute and memory take equally long."""
        return self.flops(dtype) / self.memory_bandwidth


# Dense (no structured sparsity) tensor-core figures; datasheets quote "with sparsity"
# figures at twice these. float32 is the plain CUDA-core FP32 rate (torch does not use
# TF32 for matmuls unless asked).
ACCELERATORS: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100",
        peak_flops={
            "float32": 67 * TFLOPS,
            "bfloat16": 989.4 * TFLOPS,
            "float16": 989.4 * TFLOPS,
            "fp8": 1978.9 * TFLOPS,
        },
        memory_bandwidth=3.35 * TB_S,
        memory_bytes=80 * 10**9,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM5 80GB column",
    ),
    "h200": HardwareProfile(
        name="h200",
        peak_flops={
            "float32": 67 * TFLOPS,
            "bfloat16": 989.4 * TFLOPS,
            "float16": 989.4 * TFLOPS,
            "fp8": 1978.9 * TFLOPS,
        },
        memory_bandwidth=4.8 * TB_S,
        memory_bytes=141 * 10**9,
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM 141GB column",
    ),
    "a100": HardwareProfile(
        name="a100",
        peak_flops={"float32": 19.5 * TFLOPS, "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
        memory_bandwidth=2.039 * TB_S,
        memory_bytes=80 * 10**9,
        source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column",
    ),
    "l40s": HardwareProfile(
        name="l40s",
        peak_flops={
            "float32": 91.6 * TFLOPS,
            "bfloat16": 362.05 * TFLOPS,
            "float16": 362.05 * TFLOPS,
            "fp8": 733 * TFLOPS,
        },
        memory_bandwidth=0.864 * TB_S,
        memory_bytes=48 * 10**9,
        source="NVIDIA L40S GPU datasheet",
    ),
}
HARDWARE_NAMES = (*ACCELERATORS, "cpu")


def hardware_profile(
    name: str, dtypes: tuple[str, ...] = ("float32",), threads: int | None = None
) -> HardwareProfile:
    """A named accelerator from the table, or `cpu` measured now for `dtypes` (~1-3 s).

    Called by `pdserve roofline` and by `pdserve bench engine`, which puts its step times
    next to the roofline of the same process's CPU.
    """
    if name in ACCELERATORS:
        return ACCELERATORS[name]
    if name != "cpu":
        raise ValueError(f"unknown hardware {name!r}; choose from {', '.join(HARDWARE_NAMES)}")
    return measure_cpu(tuple(sorted(set(dtypes))), threads)


@functools.cache
def measure_cpu(
    dtypes: tuple[str, ...],
    threads: int | None = None,
    num_bytes: int = 256 << 20,
    matmul_n: int = 1536,
) -> HardwareProfile:
    """Measured once per process and arguments (~1-3 s with the defaults)."""
    import psutil
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        bandwidth = read_bandwidth(num_bytes)
        flops = {dtype: matmul_flops(getattr(torch, dtype), matmul_n) for dtype in dtypes}
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    return HardwareProfile(
        name="cpu",
        peak_flops=flops,
        memory_bandwidth=bandwidth,
        memory_bytes=psutil.virtual_memory().total,
        source=f"measured now: {cpu_model()}, {used_threads} torch threads",
        measured=True,
        details={"cpu_model": cpu_model(), "threads": used_threads},
    )


class ReadProbe:
    """A read-only pass (sum) over a tensor much larger than the last-level cache, kept
    so that it can be timed again and again (between two decode steps, say). It lies on
    huge pages, as the weights and the KV pool it is the roofline of do
    (engine/host_memory.py): on 4 KiB pages the same pass reads ~10% slower, which would
    flatter every step measured against it."""

    def __init__(self, num_bytes: int = 256 << 20):
        import torch

        from engine.host_memory import huge_page_tensor

        self.num_bytes = num_bytes
        self.data = huge_page_tensor((num_bytes // 4,), torch.float32)
        self.data.fill_(1.0)

    def __call__(self, repeats: int = 1) -> float:
        """Bytes/s of the fastest of `repeats` passes."""
        from bench.timing import best_of

        return self.num_bytes / best_of(self.data.sum, repeats)


def read_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a read-only pass over a fresh probe, best of `repeats` after one untimed."""
    probe = ReadProbe(num_bytes)
    probe.data.sum()
    return probe(repeats)


def matmul_flops(dtype, n: int = 1536, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs), best of `repeats`."""
    import torch

    from bench.timing import best_of

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    return 2 * n**3 / best_of(lambda: torch.mm(a, b), repeats)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (what every recorded figure names)."""
    return _first_cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


VECTOR_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU flags the native kernels dispatch on, recorded with every saved sitting."""


def cpu_identity() -> dict:
    """What lscpu names the CPU by: model name, family and model number, and which of
    VECTOR_FEATURES it has. A virtual machine's model name is often only the vendor's
    product line; family and model then tell its generations apart."""
    fields = _first_cpuinfo_fields()
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_model": cpu_model(),
        "cpu_family": fields.get("cpu family"),
        "cpu_model_number": fields.get("model"),
        "vector_features": [name for name in VECTOR_FEATURES if name in flags],
    }


def _first_cpuinfo_fields() -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo ({} where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields
