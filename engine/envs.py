"""Every environment variable pdserve reads, declared once with its type and default."""

from __future__ import annotations

import os
from pathlib import Path


def model_cache_dir() -> Path:
    """PDSERVE_MODEL_CACHE: where converted models live (default ~/.cache/pdserve/models)."""
    default = Path.home() / ".cache" / "pdserve" / "models"
    return Path(os.environ.get("PDSERVE_MODEL_CACHE", default)).expanduser()


def api_key() -> str | None:
    """PDSERVE_API_KEY: when set, the HTTP frontend requires `Authorization: Bearer <key>`."""
    return os.environ.get("PDSERVE_API_KEY") or None


def admin_api_key() -> str | None:
    """PDSERVE_ADMIN_API_KEY: when set, the frontend's /admin endpoints require
    `Authorization: Bearer <key>`."""
    return os.environ.get("PDSERVE_ADMIN_API_KEY") or None


def cluster_token() -> str | None:
    """PDSERVE_CLUSTER_TOKEN: shared secret for worker-to-worker KV endpoints."""
    return os.environ.get("PDSERVE_CLUSTER_TOKEN") or None


def kernel_cache_dir() -> Path:
    """PDSERVE_KERNEL_CACHE: compiled native CPU kernels (default ~/.cache/pdserve/kernels)."""
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default)).expanduser()


def kernel_vector_width() -> int | None:
    """PDSERVE_KERNEL_VECTOR_WIDTH: 8 or 16 floats per vector for the native CPU kernels
    (default: 16 where the CPU has AVX-512F, else 8; 16 without AVX-512F runs, slower).
    The bf16 kernels exist only in the 16-wide build on AVX512-BF16: elsewhere bf16 runs
    on torch."""
    value = os.environ.get("PDSERVE_KERNEL_VECTOR_WIDTH", "").strip()
    if not value:
        return None
    if value not in ("8", "16"):
        raise ValueError(f"PDSERVE_KERNEL_VECTOR_WIDTH must be 8 or 16, not {value!r}")
    return int(value)


def kernel_amx() -> bool:
    """PDSERVE_KERNEL_AMX: 0 keeps multi-row bf16 projections off the AMX tiles, on the
    AVX512-BF16 dot products (for A/B runs and tests); default 1, where the CPU has AMX."""
    value = os.environ.get("PDSERVE_KERNEL_AMX", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"PDSERVE_KERNEL_AMX must be 0 or 1, not {value!r}")
    return value == "1"


def kernel_phase_clock() -> bool:
    """PDSERVE_KERNEL_PHASE_CLOCK: 1 builds the native kernels with the fused decode step's
    phase clock (`pdserve bench engine --phases` sets it); default 0."""
    value = os.environ.get("PDSERVE_KERNEL_PHASE_CLOCK", "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"PDSERVE_KERNEL_PHASE_CLOCK must be 0 or 1, not {value!r}")
    return value == "1"


def tokenizer_cache_dir() -> Path:
    """PDSERVE_TOKENIZER_CACHE: each model's effective Rust tokenizer, so workers start
    without importing transformers (default ~/.cache/pdserve/tokenizers)."""
    default = Path.home() / ".cache" / "pdserve" / "tokenizers"
    return Path(os.environ.get("PDSERVE_TOKENIZER_CACHE", default)).expanduser()


def weight_cache_dir() -> Path:
    """PDSERVE_WEIGHT_CACHE: weights prepared for the kernels (stacked, packed), mapped
    by every worker that loads the same model (default ~/.cache/pdserve/weights)."""
    default = Path.home() / ".cache" / "pdserve" / "weights"
    return Path(os.environ.get("PDSERVE_WEIGHT_CACHE", default)).expanduser()


def step_delay_s() -> float:
    """PDSERVE_STEP_DELAY_S: tests and drills only: every engine step first sleeps this
    long, a stand-in for a slower device, so request phases last long enough to act
    on (default 0)."""
    return float(os.environ.get("PDSERVE_STEP_DELAY_S", "0") or 0)


def clock_skew_s() -> float:
    """PDSERVE_CLOCK_SKEW_S: tests only: offset added to the clock worker-side timings
    read (`engine.clock`), standing in for a node whose clock is off (default 0)."""
    return float(os.environ.get("PDSERVE_CLOCK_SKEW_S", "0") or 0)


WORKER_RUN_SETTINGS = ("PDSERVE_STEP_DELAY_S", "PDSERVE_CLOCK_SKEW_S")
"""The variables above that shape a run (drills, tests) rather than a machine: the
controller hands the driver's values to every worker it starts."""


def worker_run_settings() -> dict[str, str]:
    """`WORKER_RUN_SETTINGS` set in this process. Read by the controller when it starts a
    worker actor, for that actor's environment: a worker on a Ray head started earlier,
    or on another node, inherits nothing from the driver."""
    return {name: os.environ[name] for name in WORKER_RUN_SETTINGS if name in os.environ}


def triton_interpret() -> bool:
    """TRITON_INTERPRET (Triton's own): 1 runs Triton kernels in its CPU interpreter; it
    must be set before triton is imported. The `triton` attention backend needs it on a
    CPU, where it is the debug mode that drives the GPU kernels end to end."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"
