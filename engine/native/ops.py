"""The layer operations (`engine.layer_ops`) on the float32 CPU kernels (linear.c, attention.c,
prefill_attention.c).

At load, `prepare_linear` packs each projection into strips of `strip` output columns
([N / strip][K][strip]) so that every matmul streams its weight sequentially; the
original [N, K] tensor is dropped (one copy of the weights). A tied embedding is read
back out of the packed LM head row by row. Per step, each op is one kernel call:
RMSNorm runs as the prologue of the projection that follows it, SiLU*mul as the
prologue of the down projection, and the residual adds as the matmul's epilogue.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.envs import kernel_amx
from engine.layer_ops import RESIDUAL_DTYPE, HeadSizes, Linear
from engine.native.bindings import KernelBindingError, bind
from engine.native.build import KernelBuildError, build_library, open_library

logger = logging.getLogger(__name__)

PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU_MUL = 0, 1, 2

DECODE_PHASES = ("embed", "qkv", "rope+store", "attention", "o_proj", "gate_up", "down", "lm_head")
"""The fused decode step's phases, in the order pd_phase_clock reports them (decode_step.c).
Each projection's time includes its prologue (RMSNorm, or SiLU*mul for `down`); `lm_head`
includes the final norm and each row's greedy token."""


class NativeKernels:
    """The compiled library's entry points, typed (engine/native/bindings.py): callers
    pass contiguous float32/int64 tensors' addresses, by parameter name."""

    def __init__(self, library: ctypes.CDLL):
        functions = bind(library)
        self.library = library
        self.strip = functions["pd_strip_width"]()
        self.bf16 = bool(functions["pd_has_bf16"]())
        """Built with AVX512-BF16 dot products: projections can run on bf16 weights."""
        self.use_amx = functions["pd_use_amx"]
        self.amx = bool(self.use_amx(wanted=int(kernel_amx())))
        """Multi-row bf16 projections run on AMX tiles (the CPU has them and Linux granted
        this process their state)."""
        self.linear = functions["pd_linear"]
        self.rope_store = functions["pd_rope_store"]
        self.decode_attention = functions["pd_decode_attention"]
        self.gather_kv = functions["pd_gather_kv"]
        self.prefill_attention = functions["pd_prefill_attention"]
        self.greedy_rows = functions["pd_greedy_rows"]
        self.decode_step = functions["pd_decode_step"]
        self.copy_xxh3_blocks = functions["pd_copy_xxh3_blocks"]
        """XXH3-64 digests of whole KV blocks, copying them on the way (checksum.c)."""
        self._phase_clock = functions["pd_phase_clock"]

    def decode_phases(self) -> tuple[dict[str, float], int] | None:
        """Seconds per phase of the fused decode steps since the last call, and how many
        steps that covers; None where the library was built without the phase clock
        (PDSERVE_KERNEL_PHASE_CLOCK). Called by `pdserve bench engine --phases`."""
        seconds = (ctypes.c_double * len(DECODE_PHASES))()
        steps = ctypes.c_long(0)
        found = self._phase_clock(seconds=ctypes.addressof(seconds), steps=ctypes.addressof(steps))
        if found != len(DECODE_PHASES):
            return None
        return dict(zip(DECODE_PHASES, seconds, strict=True)), steps.value


@dataclass(frozen=True)
class KernelStatus:
    """Whether this process runs the native kernels (`kernel_status()`)."""

    active: bool
    library: Path | None = None
    """The shared object loaded, where active."""
    reason: str = ""
    """Why not, where not active."""


FALLBACK = (
    "native CPU kernels unavailable (%s): CPU models run on torch ops instead (slower "
    "layers and attention) and KV transfers verify checksums in Python. To get them, "
    "install a C compiler with the C library headers (e.g. `apt-get install gcc "
    "libc6-dev`) or set CC, and install pdserve with its C sources; "
    "`python -m engine.native` builds them and says what is missing."
)
"""The one line a process logs when it cannot build or load the kernels."""


@functools.cache
def _load() -> tuple[NativeKernels | None, KernelStatus]:
    try:
        path = build_library()
        kernels = NativeKernels(open_library(path))
    except (KernelBuildError, KernelBindingError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning(FALLBACK, reason)
        return None, KernelStatus(False, reason=reason)
    return kernels, KernelStatus(True, library=path)


def native_kernels() -> NativeKernels | None:
    """The process-wide bindings, built and loaded on the first call; None (and one
    warning, `FALLBACK`) where they cannot be. Called by `engine.layer_ops`,
    `engine.attention` and `kv_transfer.integrity` when they choose a path."""
    return _load()[0]


def kernel_status() -> KernelStatus:
    """Whether the native kernels run in this process, loading them if not tried yet."""
    return _load()[1]


@dataclass
class PackedLinear:
    """A projection packed for pd_linear. float32: `packed[s, k, j]` is weight[s * strip +
    j, k]; bfloat16 (linear_bf16.c): `packed[s, k // 2, j, k % 2]`, K padded to even."""

    packed: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None

    @classmethod
    def pack(cls, projection: Linear, strip: int, bf16: bool = False) -> PackedLinear:
        weight = projection.weight.float()
        out_features, in_features = weight.shape
        padded = -(-out_features // strip) * strip
        if padded != out_features:
            weight = F.pad(weight, (0, 0, 0, padded - out_features))
        bias = None if projection.bias is None else projection.bias.float().contiguous()
        if bf16:
            weight = F.pad(weight, (0, in_features % 2)).to(torch.bfloat16)
            pairs = weight.shape[1] // 2
            packed = weight.view(padded // strip, strip, pairs, 2).transpose(1, 2).contiguous()
        else:
            packed = weight.view(padded // strip, strip, in_features).transpose(1, 2).contiguous()
        return cls(packed, out_features, in_features, bias)

    @property
    def bf16(self) -> bool:
        return self.packed.dtype == torch.bfloat16

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * 4
        return self.out_features * self.in_features * self.packed.element_size() + extra

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """weight[ids] as float32 [len(ids), in_features]: the tied embedding lookup."""
        if self.bf16:
            strip = self.packed.shape[2]
            pairs = self.packed[ids // strip, :, ids % strip, :]
            return pairs.reshape(len(ids), -1)[:, : self.in_features].float()
        strip = self.packed.shape[-1]
        return self.packed[ids // strip, :, ids % strip]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeOps:
    """`engine.layer_ops.TorchOps`' interface on the native kernels (CPU). Activations
    and the residual are float32; the projections' weights are float32, or bfloat16
    with `weights_bf16` (the kernels then round each projection's input to bf16); the
    KV pool is float32 or bfloat16 (`rope_store` then rounds k and v as it stores them,
    in qkv too, so that every attention path reads the same values). `deterministic`:
    every projection sums a row's columns in one order whatever the number of rows
    (linear.c's `linear_team`), so a row's bits do not depend on its batch."""

    name = "native"

    def __init__(
        self,
        kernels: NativeKernels,
        eps: float,
        weights_bf16: bool = False,
        deterministic: bool = False,
    ):
        if weights_bf16 and not kernels.bf16:
            raise ValueError("these kernels were built without AVX512-BF16")
        self.kernels = kernels
        self.eps = eps
        self.weights_bf16 = weights_bf16
        self.deterministic = deterministic
        self.threads = torch.get_num_threads()
        self._scratch = torch.empty(0)
        self.prepared_layout = f"native-strip{kernels.strip}" + ("-bf16" if weights_bf16 else "")

    def prepare_linear(self, projection: Linear) -> PackedLinear:
        return PackedLinear.pack(projection, self.kernels.strip, self.weights_bf16)

    def begin_step(self) -> None:
        # Per step, from the thread that runs it: torch's thread count is per thread.
        self.threads = torch.get_num_threads()

    def embed(self, input_ids: torch.Tensor, table) -> torch.Tensor:
        if isinstance(table, PackedLinear):
            return table.rows(input_ids).contiguous()
        return F.embedding(input_ids, table.weight).to(RESIDUAL_DTYPE)

    def _scratch_for(self, rows: int, cols: int) -> torch.Tensor:
        if self._scratch.numel() < rows * cols:
            self._scratch = torch.empty(rows * cols, dtype=torch.float32)
        return self._scratch

    def _linear(self, x, projection: PackedLinear, out, prologue, norm_weight, accumulate):
        rows, k = x.shape[0], projection.in_features
        needs_scratch = prologue != PROLOGUE_NONE or projection.bf16
        scratch = self._scratch_for(rows, k) if needs_scratch else None
        self.kernels.linear(
            x=x.data_ptr(),
            ldx=x.stride(0),
            M=rows,
            K=k,
            w_packed=projection.packed.data_ptr(),
            N=projection.out_features,
            bias=_ptr(projection.bias),
            prologue=prologue,
            norm_weight=_ptr(norm_weight),
            eps=self.eps,
            scratch=_ptr(scratch),
            y=out.data_ptr(),
            ldy=out.stride(0),
            accumulate=int(accumulate),
            weights_bf16=int(projection.bf16),
            deterministic=int(self.deterministic),
            nthreads=self.threads,
        )

    def norm_linear(self, residual, norm_weight, projection: PackedLinear) -> torch.Tensor:
        out = torch.empty(residual.shape[0], projection.out_features)
        self._linear(residual, projection, out, PROLOGUE_RMSNORM, norm_weight, False)
        return out

    def linear_add(self, x, projection: PackedLinear, residual: torch.Tensor) -> None:
        self._linear(x, projection, residual, PROLOGUE_NONE, None, True)

    def glu_linear_add(self, gate_up, projection: PackedLinear, residual: torch.Tensor) -> None:
        self._linear(gate_up, projection, residual, PROLOGUE_SILU_MUL, None, True)

    def rope_store(self, qkv, positions, rope, kv_pool, layer: int, meta, sizes: HeadSizes):
        num_tokens = qkv.shape[0]
        keys, values = kv_pool.layer_view(layer, 0), kv_pool.layer_view(layer, 1)
        self.kernels.rope_store(
            qkv=qkv.data_ptr(),
            ldqkv=qkv.stride(0),
            T=num_tokens,
            Hq=sizes.num_heads,
            Hkv=sizes.num_kv_heads,
            D=sizes.head_dim,
            positions=positions.data_ptr(),
            cos_table=rope.cos.data_ptr(),
            sin_table=rope.sin.data_ptr(),
            k_cache=keys.data_ptr(),
            v_cache=values.data_ptr(),
            block_stride=keys.stride(0),
            slot_blocks=meta.slot_blocks.data_ptr(),
            slot_offsets=meta.slot_offsets.data_ptr(),
            nthreads=self.threads,
            kv_bf16=kv_pool.holds_bf16,
        )
        q, k, v = qkv.split(sizes.split, dim=-1)
        return (
            q.view(num_tokens, sizes.num_heads, sizes.head_dim),
            k.view(num_tokens, sizes.num_kv_heads, sizes.head_dim),
            v.view(num_tokens, sizes.num_kv_heads, sizes.head_dim),
        )
