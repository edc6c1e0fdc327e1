"""The C kernels ship: a non-editable install of the package, imported from outside the
repository, compiles them from the sources it carries and runs them.

An editable install (the dev venv) imports `engine/native/` from the repository, where
the `.c` and `.h` files always are, so only an install that copies the package (a wheel,
`pip install .`, the Docker image) shows whether they are package data. The install goes
into a fresh `--target` directory from a copy of what the build reads, so neither the
worktree nor the shared venv is touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md")
PACKAGES = ("engine", "prefill_worker", "decode_worker", "kv_transfer", "proto", "cluster", "bench")

PROBE = r"""
import json

import numpy as np
import torch
import xxhash

import engine
from engine.layer_ops import Linear
from engine.native.ops import NativeOps, kernel_status, native_kernels

status = kernel_status()
report = {"engine_file": engine.__file__, "active": status.active, "reason": status.reason}
kernels = native_kernels()
if kernels is not None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=generator)
    x = torch.randn(3, 24, generator=generator)
    residual = torch.zeros(3, 40)
    ops = NativeOps(kernels, eps=1e-5)
    ops.linear_add(x, ops.prepare_linear(Linear(weight)), residual)
    reference = x.double() @ weight.double().T
    report["linear_max_error"] = (residual.double() - reference).abs().max().item()
    blocks = np.random.default_rng(0).integers(0, 256, (3, 1000), dtype=np.uint8)
    copied, digests = np.zeros_like(blocks), np.zeros(3, dtype=np.uint64)
    kernels.copy_xxh3_blocks(
        src=blocks.ctypes.data,
        dst=copied.ctypes.data,
        block_nbytes=1000,
        count=3,
        out=digests.ctypes.data,
    )
    report["digests"] = digests.tolist()
    report["expected_digests"] = [xxhash.xxh3_64_intdigest(block) for block in blocks]
    report["copy_equal"] = bool((copied == blocks).all())
print(json.dumps(report))
"""


def copy_build_inputs(destination: Path) -> None:
    """What setuptools reads to build the package, without caches or build outputs."""
    destination.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy2(REPO / name, destination / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for package in PACKAGES:
        shutil.copytree(REPO / package, destination / package, ignore=ignore)


@pytest.mark.slow
def test_a_non_editable_install_ships_and_loads_the_native_kernels(tmp_path):
    source, site, cache = tmp_path / "src", tmp_path / "site", tmp_path / "kernel-cache"
    copy_build_inputs(source)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
    install = subprocess.run(
        [*pip, "--no-build-isolation", "--target", str(site), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PDSERVE_KERNEL_CACHE", "CC")
    }
    env |= {"PYTHONPATH": str(site), "PDSERVE_KERNEL_CACHE": str(cache)}
    probe = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: it must not be importable from here
        env=env,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    report = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(report["engine_file"]).is_relative_to(site), report
    assert report["active"], report["reason"]
    assert report["linear_max_error"] < 1e-4, report
    assert report["digests"] == report["expected_digests"] and report["copy_equal"], report
    assert len(list(cache.glob("pdserve_kernels_*.so"))) == 1  # compiled from what shipped
