"""Compile the C kernels (`*.c`, `native.h`) once per machine and load them; `None`
where that is not possible.

Called by `engine.native.ops.native_kernels()` the first time an engine wants the
float32 CPU kernels. The shared object is cached under `PDSERVE_KERNEL_CACHE`
(default ~/.cache/pdserve/kernels), named by a hash of the source, the compiler
flags, the compiler's version and the CPU's model and flags (`-march=native` code
must not run on a CPU it was not built for). The vector width follows the CPU: 16 floats
(zmm) where it has AVX-512F, 8 (ymm) otherwise; `PDSERVE_KERNEL_VECTOR_WIDTH` overrides
it; `PDSERVE_KERNEL_PHASE_CLOCK=1` builds (and caches apart) the variant with the fused
decode step's phase clock. Several workers starting at once may
all compile; each writes a private temporary file and renames it into place, so a
reader never sees a half-written library. A cold compile takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.envs import kernel_cache_dir, kernel_phase_clock, kernel_vector_width
from engine.platform import cpu_flags

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


def vector_width() -> int:
    """Floats per vector the kernels are built for. On a CPU with AVX-512F a
    512-token prefill's projections ran at 360 GFLOP/s on 16 lanes against 170-210 on 8
    on two cores. Where the CPU has no AVX-512F, a 16-float build
    still runs (GCC splits each vector into two ymm) but slower, and without the bf16
    kernels: the tests build it there to check both widths give the same bits."""
    return kernel_vector_width() or (16 if "avx512f" in cpu_flags() else 8)


def _flags() -> tuple[str, ...]:
    clock = ("-DPD_PHASE_CLOCK",) if kernel_phase_clock() else ()
    return (*FLAGS, f"-DVL={vector_width()}", *clock)


class KernelBuildError(RuntimeError):
    """The C compiler is missing or failed; the caller falls back to torch ops."""


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise KernelBuildError("no C compiler (gcc/cc) on PATH")
    return compiler


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def _cache_key(compiler: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256()
    for path in [*_sources(), *sorted(SOURCE_DIR.glob("*.h"))]:
        digest.update(path.name.encode() + path.read_bytes())
    for part in (" ".join(_flags()), version, _cpu_model(), " ".join(sorted(cpu_flags()))):
        digest.update(part.encode())
    return digest.hexdigest()[:20]


def build_library(cache_dir: Path | None = None) -> Path:
    """Path of the compiled library for this machine, compiling it if not cached."""
    compiler = _compiler()
    cache_dir = cache_dir or kernel_cache_dir()
    target = cache_dir / f"pdserve_kernels_{_cache_key(compiler)}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_flags(), *map(str, _sources()), "-o", scratch, "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    logger.info("compiled native kernels into %s", target)
    return target


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The kernels, loaded once per process; None (and one warning) if they cannot be built.

    torch must be imported first: the library links `libgomp.so.1`, and the loader then
    binds it to the OpenMP runtime torch already holds, so both share one thread pool.
    """
    import torch  # noqa: F401 - see the docstring

    try:
        return ctypes.CDLL(str(build_library()))
    except (KernelBuildError, OSError) as exc:
        logger.warning("native CPU kernels unavailable (%s); using torch ops", exc)
        return None
