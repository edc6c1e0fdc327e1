"""The C kernels' entry points, declared once: each one's parameters by name and ctypes
type, its result type, and the structs `pd_decode_step` reads.

`bind(library)` is called by `engine.native.ops.native_kernels()` when the library
loads. It makes each entry point a ctypes function from a prototype with named
parameters, so a call must pass exactly the declared parameters (by position or by
name) and each of its declared type: a missing, extra or misnamed argument raises
TypeError, a wrong type raises ctypes.ArgumentError, where a plain CDLL function would
hand the C code whatever it was given (ctypes passes extra arguments to a C function
unchecked). Callers pass the many-argument kernels' arguments by name. The structs'
sizes are checked against the library's own (`pd_struct_sizes`), so a field added on
one side only fails at load instead of corrupting a decode step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_I64 = ctypes.c_int64


class LayerWeights(ctypes.Structure):
    """decode_step.c's `pd_layer_weights`: one layer's weights (packed projections)."""

    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "o_proj",
            "o_bias",
            "gate_up",
            "down",
        )
    ]


class Model(ctypes.Structure):
    """decode_step.c's `pd_model`: the shapes and weights of a whole model."""

    _fields_ = [
        *((name, _L) for name in ("num_layers", "hidden", "intermediate", "num_heads")),
        *((name, _L) for name in ("num_kv_heads", "head_dim", "vocab")),
        ("eps", _F),
        ("scale", _F),
        ("layers", ctypes.POINTER(LayerWeights)),
        *((name, _P) for name in ("final_norm", "lm_head", "embed", "rope_cos", "rope_sin")),
        ("weights_bf16", _I),
        ("deterministic", _I),
    ]


BATCH_POINTERS = ("tokens", "positions", "slot_blocks", "slot_offsets", "block_tables")
SCRATCH_BUFFERS = ("residual", "qkv", "attn", "gate_up", "scratch")
BATCH_BUFFERS = (*SCRATCH_BUFFERS, "logits")


class DecodeBatch(ctypes.Structure):
    """decode_step.c's `pd_decode_batch`: one decode step's rows, the pool, the buffers."""

    _fields_ = [
        ("rows", _L),
        *((name, _P) for name in (*BATCH_POINTERS, "context_lens")),
        ("table_stride", _L),
        ("kv", _P),
        *((name, _L) for name in ("block_stride", "layer_stride", "kind_stride", "block_size")),
        *((name, _P) for name in BATCH_BUFFERS),
        ("kv_bf16", _I),
        ("greedy", _P),
    ]


STRUCTS = (LayerWeights, Model, DecodeBatch)
"""In the order `pd_struct_sizes` reports their sizes."""


@dataclass(frozen=True)
class Signature:
    """One entry point: its parameters (C name, ctypes type) in order, and its result."""

    params: tuple[tuple[str, type], ...]
    restype: type | None

    def bind(self, library: ctypes.CDLL, name: str):
        """The typed function; the library's own attribute gets the types too, so that
        even a direct `library.pd_...` call converts its arguments as declared."""
        plain = getattr(library, name)
        plain.argtypes, plain.restype = [kind for _, kind in self.params], self.restype
        prototype = ctypes.CFUNCTYPE(self.restype, *plain.argtypes)
        return prototype((name, library), tuple((1, param) for param, _ in self.params))


def _sig(restype: type | None, *params: tuple[str, type]) -> Signature:
    return Signature(params, restype)


# The kernels that touch the KV pool end with `kv_bf16`: it holds bf16, not float32.
def _attention_head(rows: str) -> tuple[tuple[str, type], ...]:
    """The parameters both attention kernels start with; `rows`: the query rows' count
    (decode rows R, or a prefill chunk's tokens T)."""
    return (
        *(("q", _P), ("ldq", _L), (rows, _L), ("Hq", _L), ("Hkv", _L), ("D", _L)),
        *(("k_cache", _P), ("v_cache", _P), ("block_stride", _L), ("block_size", _L)),
    )


SIGNATURES: dict[str, Signature] = {
    "pd_strip_width": _sig(_I),
    "pd_has_bf16": _sig(_I),
    "pd_use_amx": _sig(_I, ("wanted", _I)),
    "pd_linear": _sig(
        None,
        *(("x", _P), ("ldx", _L), ("M", _L), ("K", _L), ("w_packed", _P), ("N", _L)),
        *(("bias", _P), ("prologue", _I), ("norm_weight", _P), ("eps", _F)),
        *(("scratch", _P), ("y", _P), ("ldy", _L), ("accumulate", _I)),
        *(("weights_bf16", _I), ("deterministic", _I), ("nthreads", _I)),
    ),
    "pd_rope_store": _sig(
        None,
        *(("qkv", _P), ("ldqkv", _L), ("T", _L), ("Hq", _L), ("Hkv", _L), ("D", _L)),
        *(("positions", _P), ("cos_table", _P), ("sin_table", _P)),
        *(("k_cache", _P), ("v_cache", _P), ("block_stride", _L)),
        *(("slot_blocks", _P), ("slot_offsets", _P), ("nthreads", _I), ("kv_bf16", _I)),
    ),
    "pd_decode_attention": _sig(
        _I,
        *_attention_head("R"),
        *(("block_tables", _P), ("table_stride", _L), ("context_lens", _P)),
        *(("scale", _F), ("out", _P), ("ldo", _L), ("nthreads", _I), ("kv_bf16", _I)),
        ("deterministic", _I),
    ),
    "pd_gather_kv": _sig(
        None,
        *(("k_cache", _P), ("v_cache", _P), ("block_stride", _L), ("block_size", _L)),
        *(("Hkv", _L), ("D", _L), ("table", _P), ("n", _L)),
        *(("k_out", _P), ("v_out", _P), ("nthreads", _I), ("kv_bf16", _I)),
    ),
    "pd_prefill_attention": _sig(
        _I,
        *_attention_head("T"),
        *(("table", _P), ("context_start", _L), ("scale", _F)),
        *(("out", _P), ("ldo", _L), ("nthreads", _I), ("kv_bf16", _I)),
    ),
    "pd_copy_xxh3_blocks": _sig(
        _I, ("src", _P), ("dst", _P), ("block_nbytes", _I64), ("count", _I64), ("out", _P)
    ),
    "pd_greedy_rows": _sig(
        None, ("x", _P), ("rows", _L), ("N", _L), ("tokens", _P), ("nthreads", _I)
    ),
    "pd_phase_clock": _sig(_I, ("seconds", _P), ("steps", _P)),
    "pd_decode_step": _sig(
        _I,
        ("m", ctypes.POINTER(Model)),
        ("b", ctypes.POINTER(DecodeBatch)),
        ("nthreads", _I),
    ),
    "pd_struct_sizes": _sig(None, ("sizes", _P)),
}


class KernelBindingError(RuntimeError):
    """The library does not match these declarations (a missing entry point, a struct of
    another size): it was built from other sources than this module's."""


def bind(library: ctypes.CDLL) -> dict[str, object]:
    """Every entry point of `library` as a typed ctypes function, by its C name."""
    functions = {}
    for name, signature in SIGNATURES.items():
        try:
            functions[name] = signature.bind(library, name)
        except AttributeError as exc:
            raise KernelBindingError(f"the library has no {name}: {exc}") from exc
    sizes = (ctypes.c_long * len(STRUCTS))()
    functions["pd_struct_sizes"](ctypes.addressof(sizes))
    for struct, size in zip(STRUCTS, sizes, strict=True):
        if ctypes.sizeof(struct) != size:
            raise KernelBindingError(
                f"{struct.__name__} is {ctypes.sizeof(struct)} bytes here, {size} in C"
            )
    return functions
