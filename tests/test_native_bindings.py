"""The native kernels' typed bindings (engine/native/bindings.py) and their fallback.

A ctypes call that does not match its C function is a segfault or silently wrong
memory, so the declarations are checked three ways: against the C sources' own
prototypes (names, count and types of every parameter), by calls that must raise, and
by the library's struct sizes at load. Where the kernels cannot be built the process
says so in one line and runs torch ops."""

from __future__ import annotations

import ctypes
import logging
import re

import numpy as np
import pytest
import torch

from engine.native import bindings, build
from engine.native.bindings import SIGNATURES, KernelBindingError, bind
from engine.native.build import SOURCE_DIR, KernelBuildError, build_library
from engine.native.ops import FALLBACK, _load, kernel_status, native_kernels

needs_native = pytest.mark.skipif(native_kernels() is None, reason="no C compiler here")

C_TYPES = {
    "long": ctypes.c_long,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "int64_t": ctypes.c_int64,
}


def c_prototypes() -> dict[str, list[tuple[str, object]]]:
    """Every exported `pd_*` function in the sources: its parameters as (name, ctypes type),
    a pointer as `"pointer"`."""
    found = {}
    pattern = re.compile(r"^(?:void|int|long) (pd_\w+)\(([^)]*)\)\s*\{", re.MULTILINE)
    for path in sorted(SOURCE_DIR.glob("*.c")):
        for name, params in pattern.findall(path.read_text()):
            parsed = []
            for param in filter(None, (p.strip() for p in params.split(","))):
                if param == "void":
                    continue
                match = re.fullmatch(r"(?:const )?(\w+)\s*(\*?)\s*(\w+)", param)
                assert match, (name, param)
                kind, star, param_name = match.groups()
                parsed.append((param_name, "pointer" if star else C_TYPES[kind]))
            found.setdefault(name, parsed)
    return found


def _c_kind(kind):
    """A declared ctypes type as `c_prototypes` reads the C one (a POINTER type's `_type_`
    is the class pointed to, a simple type's a format letter)."""
    return "pointer" if kind is ctypes.c_void_p or isinstance(kind._type_, type) else kind


def test_every_declared_signature_matches_its_c_prototype():
    prototypes = c_prototypes()
    assert set(prototypes) == set(SIGNATURES)
    for name, signature in SIGNATURES.items():
        declared = [(param, _c_kind(kind)) for param, kind in signature.params]
        assert declared == prototypes[name], name


@needs_native
def test_a_call_that_does_not_match_its_signature_raises_instead_of_running():
    """Each mismatch is caught by ctypes before the C function runs: the destination
    stays untouched."""
    copy_hash = native_kernels().copy_xxh3_blocks
    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, dtype=np.uint8)
    out = np.zeros(1, dtype=np.uint64)
    right = dict(src=src.ctypes.data, dst=dst.ctypes.data, block_nbytes=256, count=1)
    with pytest.raises(TypeError, match="exactly 5 arguments"):
        copy_hash(src.ctypes.data, dst.ctypes.data, 256, 1, out.ctypes.data, 7)
    with pytest.raises(TypeError, match="required argument 'out' missing"):
        copy_hash(src.ctypes.data, dst.ctypes.data, 256, 1)
    with pytest.raises(TypeError, match="required argument 'out' missing"):
        copy_hash(**right, output=out.ctypes.data)
    with pytest.raises(ctypes.ArgumentError, match="argument 3"):
        copy_hash(**{**right, "block_nbytes": 256.0}, out=out.ctypes.data)
    with pytest.raises(ctypes.ArgumentError, match="argument 1"):
        copy_hash(**{**right, "src": torch.zeros(4)}, out=out.ctypes.data)
    assert not dst.any() and not out.any()
    assert copy_hash(**right, out=out.ctypes.data) == 0  # the matching call runs
    assert np.array_equal(dst, src) and out[0] != 0


@needs_native
def test_a_struct_of_another_size_than_the_library_s_fails_the_load(monkeypatch):
    class ShortBatch(ctypes.Structure):
        _fields_ = [("rows", ctypes.c_long)]

    library = native_kernels().library
    assert bind(library)  # the shipped declarations match
    monkeypatch.setattr(bindings, "STRUCTS", (*bindings.STRUCTS[:2], ShortBatch))
    with pytest.raises(KernelBindingError, match="ShortBatch is 8 bytes here"):
        bind(library)


@needs_native
def test_the_process_reports_its_kernels_active():
    status = kernel_status()
    assert status.active and status.reason == ""
    assert status.library == build_library() and status.library.is_file()


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("no-compiler", "no C compiler (CC=/nonexistent/cc is not an executable)"),
        ("no-sources", "the C sources are not installed in"),
    ],
)
def test_kernels_that_cannot_be_built_fall_back_with_one_warning(
    monkeypatch, tmp_path, caplog, fault, reason
):
    """Without a compiler, or in a package installed without its C sources, the engine
    runs torch ops and logs one line saying so, why, and how to get the kernels."""
    if fault == "no-compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    else:
        monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KernelBuildError, match=re.escape(reason)):
        build_library()
    with caplog.at_level(logging.WARNING, logger="engine.native.ops"):
        kernels, status = _load.__wrapped__()  # uncached: the process's own load stays
    assert kernels is None and not status.active and status.reason.startswith(reason)
    assert [r.getMessage() for r in caplog.records] == [FALLBACK % status.reason]
    assert "apt-get install gcc" in caplog.records[0].getMessage()
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.so"))
