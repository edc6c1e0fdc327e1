"""What the hardware under this process can do fast; used to resolve `dtype: auto`."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls beat fp32. On AVX2-only CPUs they are 3-6x slower."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def auto_dtype(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return (
            "bfloat16"
            if torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            else "float16"
        )
    return "bfloat16" if cpu_has_fast_bf16() else "float32"
