"""Compile the Triton kernels for a Hopper GPU (sm_90) on a machine without one.

Run in its own process, without TRITON_INTERPRET (the interpreter never compiles):
`python -m tests.triton_compile_check`. Triton lowers each kernel through its GPU
passes and ptxas (shipped with triton) to a cubin, so a kernel that would not build on
a GPU (a dot of mismatched dtypes or too-small tiles, a constexpr path that does not
type-check, shared memory over the device's) fails here, not on the first GPU run.
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import triton_attention, triton_kv_store

TARGET = GPUTarget("cuda", 90, 32)
HOPPER_SHARED_BYTES = 227 << 10
POINTERS = {"tables_ptr", "seq_lens_ptr", "query_starts_ptr", "blocks_ptr", "offsets_ptr"}
"""Pointer arguments to int64 tensors; every other *_ptr is to the data's dtype."""


def _signature(fn, constants: dict, dtype: str) -> dict:
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*i64"
        elif name.startswith("part_"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*" + dtype
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i64"  # strides, the window
    return signature


def compile_kernel(fn, constants: dict, dtype: str) -> int:
    """Build `fn` for sm_90; returns the shared memory its launch needs."""
    source = ASTSource(fn, _signature(fn, constants, dtype), constants)
    return triton.compile(source, target=TARGET).metadata.shared


def attention_constants(group, head_dim, decode, splits, window, dtype) -> dict:
    head_pad = max(16, triton.next_power_of_2(head_dim))
    rows = triton_attention.DECODE_ROWS if decode else triton_attention.PREFILL_ROWS
    block_m = max(rows, triton.next_power_of_2(group))
    return dict(
        NUM_HEADS=2 * group, GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=1 if decode else block_m // group,
        TILE_N=triton_attention.KEY_TILE, DECODE=decode, NUM_SPLITS=splits,
        USE_WINDOW=window, DOT_F32=dtype == "fp32",
    )  # fmt: skip


CASES = [
    # (dtype, group, head_dim, decode, splits, window)
    ("bf16", 4, 128, True, 8, True),
    ("bf16", 8, 128, False, 1, False),
    ("fp16", 3, 20, False, 1, True),
    ("fp32", 4, 64, True, 1, False),
    ("fp32", 8, 128, False, 1, False),
]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1 runs kernels, it never compiles them", file=sys.stderr)
        return 2
    for dtype, *shape in CASES:
        constants = attention_constants(*shape, dtype)
        shared = compile_kernel(triton_attention._attention_kernel, constants, dtype)
        assert shared <= HOPPER_SHARED_BYTES, (dtype, shape, shared)
        print(f"attention {dtype} {shape}: {shared} bytes of shared memory")
    merge = dict(NUM_HEADS=8, HEAD_DIM=128, HEAD_PAD=128, NUM_SPLITS=3, SPLITS_PAD=4)
    compile_kernel(triton_attention._merge_kernel, merge, "bf16")
    for heads, head_dim in ((1, 128), (3, 20)):
        store = dict(
            NUM_KV_HEADS=heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(heads),
            HEAD_PAD=triton.next_power_of_2(head_dim),
        )
        compile_kernel(triton_kv_store._store_kernel, store, "bf16")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
