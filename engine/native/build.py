"""Compile the C kernels (`*.c`, `native.h`, xxHash's `xxhash.h`) once per machine.

Called by `engine.native.ops.native_kernels()` the first time a process wants the
float32 CPU kernels, and by `python -m engine.native` (the Docker image's build runs it
so that a missing compiler fails the image, not the server). The sources ship in the
package (pyproject's package data), so an installed copy compiles too. The shared
object is cached under `PDSERVE_KERNEL_CACHE` (default ~/.cache/pdserve/kernels), named
by a hash of the sources, the compiler flags, the compiler's version and the CPU's model
and flags (`-march=native` code must not run on a CPU it was not built for), so every
later process on the machine, every worker included, loads it without compiling. The
vector width follows the CPU: 16 floats (zmm) where it has AVX-512F, 8 (ymm) otherwise;
`PDSERVE_KERNEL_VECTOR_WIDTH` overrides it; `PDSERVE_KERNEL_PHASE_CLOCK=1` builds (and
caches apart) the variant with the fused decode step's phase clock. Workers that start
together take a lock per library, so one compiles while the others wait for its result
(a cold compile takes 10-20 s of one core); the compiler writes a private temporary file
that is renamed into place, so a reader never sees a half-written library.
"""

from __future__ import annotations

import ctypes
import fcntl
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
    """The C compiler is missing or failed, or the sources are not installed; the caller
    falls back to torch ops."""


def _compiler() -> str:
    chosen = os.environ.get("CC")
    compiler = shutil.which(chosen) if chosen else shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        where = f"CC={chosen} is not an executable" if chosen else "no gcc or cc on PATH"
        raise KernelBuildError(f"no C compiler ({where})")
    return compiler


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


HEADERS = ("native.h", "xxhash.h")
"""Headers the sources include; with the `.c` files, what the package must ship."""


def _sources() -> list[Path]:
    """The `.c` files to compile; KernelBuildError where the package lacks them."""
    sources = sorted(SOURCE_DIR.glob("*.c"))
    missing = [name for name in HEADERS if not (SOURCE_DIR / name).is_file()]
    if not sources or missing:
        raise KernelBuildError(
            f"the C sources are not installed in {SOURCE_DIR} (this copy of pdserve was "
            "built without its package data)"
        )
    return sources


def _cache_key(compiler: str, sources: list[Path]) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256()
    for path in [*sources, *(SOURCE_DIR / name for name in HEADERS)]:
        digest.update(path.name.encode() + path.read_bytes())
    for part in (" ".join(_flags()), version, _cpu_model(), " ".join(sorted(cpu_flags()))):
        digest.update(part.encode())
    return digest.hexdigest()[:20]


def build_library(cache_dir: Path | None = None) -> Path:
    """Path of the compiled library for this machine, compiling it if not cached.
    Raises KernelBuildError where it cannot be built."""
    compiler, sources = _compiler(), _sources()
    cache_dir = cache_dir or kernel_cache_dir()
    target = cache_dir / f"pdserve_kernels_{_cache_key(compiler, sources)}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not target.is_file():  # another process may have built it while we waited
            _compile(compiler, sources, target)
    return target


def _compile(compiler: str, sources: list[Path], target: Path) -> None:
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_flags(), *map(str, sources), "-o", scratch, "-lm"],
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


def open_library(path: Path) -> ctypes.CDLL:
    """The compiled library, loaded into this process.

    torch must be imported first: the library links `libgomp.so.1`, and the loader then
    binds it to the OpenMP runtime torch already holds, so both share one thread pool.
    """
    import torch  # noqa: F401 - see the docstring

    return ctypes.CDLL(str(path))
