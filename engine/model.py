"""Llama-family forward (Llama, Mistral, Qwen2) over the paged KV pool.

Tokens of all sequences in a step are packed into one [T, hidden] batch so the
projections run as large matmuls; only attention looks at sequence boundaries
(see `engine.attention`). Logits are computed only for the rows a sampler needs.

Each layer is written in a few grouped operations (`engine.layer_ops`); which
implementation runs them is chosen once at load (`kernels`): the native float32 CPU
kernels (`engine.native`), which fuse each group into one call and stream weights
packed for them, or the torch reference (any device, any dtype). With native ops and
native attention, a decode-only step runs as one native call (`FusedDecode`).

The residual stream stays in float32 whatever the weights' dtype: with bf16 weights,
a bf16 residual (8-bit mantissa) drops layer updates that are small next to its
outliers (SmolLM2 reaches ~25000, where one bf16 step is 128): on the demo model the
hidden states after layer 20 were 2.9% off the fp32 reference with a bf16 residual,
2.1% with this one. Matmuls still run in the weights' dtype; only the [tokens, hidden]
adds and norms run in float32.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.attention import (
    AttentionBackend,
    AttentionChoice,
    AttentionMetadata,
    make_attention_backend,
)
from engine.kv_cache import KVCachePool
from engine.layer_ops import (
    RESIDUAL_DTYPE,
    HeadSizes,
    KernelChoice,
    TorchOps,
    activation_dtype,
    make_layer_ops,
)
from engine.model_spec import ModelSpec
from engine.native.decode_step import DecodeRows, FusedDecode, FusedStep
from engine.rope import RotaryEmbedding
from engine.threads import ThreadChoice
from engine.weight_cache import load_prepared_weights
from engine.weights import LayerWeights

__all__ = ["RESIDUAL_DTYPE", "LlamaForward"]


class LlamaForward:
    """Holds the weights of one model and runs packed forward steps over a KV pool."""

    def __init__(
        self,
        model_dir: str | Path,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: str = "cpu",
        max_positions: int | None = None,
        attention: AttentionBackend | AttentionChoice | None = None,
        kernels: KernelChoice = "auto",
        kv_dtype: torch.dtype | None = None,
        block_size: int = 16,
        deterministic: bool = False,
    ):
        """`deterministic`: batch-invariant layer ops and attention (the `deterministic`
        setting); raises ValueError where this device and these choices have none."""
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.deterministic = deterministic
        if attention == "triton" and kernels == "auto":
            # The GPU path whole, wherever it runs: torch's layer ops and the Triton KV
            # store (on a CPU, the interpreter's debug mode; not the native kernels).
            kernels = "torch"
        self.ops = make_layer_ops(kernels, dtype, device, spec.rms_norm_eps, deterministic)
        self.activation_dtype = activation_dtype(kernels, dtype, device)
        """Of the activations: float32 on the native kernels, whose bf16 mode keeps the
        projections' weights (and, by default, the KV cache) in bf16."""
        self.weights = load_prepared_weights(
            Path(model_dir), spec, self.activation_dtype, device, self.ops
        )
        self.rope = RotaryEmbedding(
            spec.hf_config,
            max_positions or spec.max_position_embeddings,
            self.activation_dtype,
            device,
        )
        if not isinstance(attention, AttentionBackend):
            kernel_kind = "torch" if self.ops.name == "torch" else "auto"
            attention = make_attention_backend(
                attention or "auto",
                self.activation_dtype,
                device,
                kernel_kind,
                block_size,
                deterministic,
            )
        self.attention = attention
        if attention.kv_store is not None and isinstance(self.ops, TorchOps):
            self.ops.use_kv_store(attention.kv_store)
        self.kv_dtype = kv_dtype or dtype
        """Of the KV pool this forward writes and reads: the weights' dtype unless asked
        otherwise; one that differs from the activations' needs the native kernels."""
        self._check_kv_dtype()
        self._check_deterministic()
        self.scale = spec.head_dim**-0.5
        self.heads = HeadSizes(spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.thread_choice: ThreadChoice | None = None
        self.pin_threads = False
        """True: every step runs on torch's configured thread count (benchmarks)."""
        self.last_threads = 0
        """Threads the latest native CPU step ran on (0: not chosen), for the step trace."""
        self.fused_decode: FusedDecode | None = None
        if self.ops.name == "native" and attention.name == "native":
            self.fused_decode = FusedDecode(self.ops.kernels, self)

    def _check_kv_dtype(self) -> None:
        if self.kv_dtype == self.activation_dtype:
            return
        if self.ops.name != "native" or self.attention.name != "native":
            raise ValueError(
                f"a {str(self.kv_dtype).removeprefix('torch.')} KV cache under "
                f"{str(self.activation_dtype).removeprefix('torch.')} activations needs the "
                "native CPU kernels and attention; set kv_cache_dtype to 'auto'"
            )

    def _check_deterministic(self) -> None:
        if not self.deterministic:
            return
        if not getattr(self.attention, "deterministic", False):
            raise ValueError(
                f"deterministic mode needs a batch-invariant attention backend (native or "
                f"triton, built with deterministic=True), not {self.attention.name!r}"
            )
        if self.attention.name == "native" and self.spec.head_dim % 16:
            raise ValueError(
                "deterministic mode on the native kernels needs a head dim that is a multiple "
                f"of 16 (what their prefill attention takes), not {self.spec.head_dim}"
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVCachePool,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run one packed step; returns float32 logits [len(logits_rows), vocab].

        With the native kernels the step runs on the thread count that has been fastest for
        steps like it (`engine.threads`): all of torch's threads, or one when other work
        shares the cores. Their results do not depend on the thread count; torch's ops may,
        so the torch path keeps the configured count."""
        if self.ops.name != "native":
            return self._step(input_ids, positions, meta, kv_pool, logits_rows)
        configured = torch.get_num_threads()
        key = (not meta.prefill_chunks, input_ids.shape[0].bit_length())
        threads = self._pick_threads(key, configured)
        torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            logits = self._step(input_ids, positions, meta, kv_pool, logits_rows)
        finally:
            torch.set_num_threads(configured)
        self.thread_choice.record(key, threads, time.perf_counter() - start)
        return logits

    def decode(self, rows: DecodeRows, kv_pool: KVCachePool) -> FusedStep | None:
        """A decode-only step on the fused native kernel, from plain ints: the engine's
        path for such steps (`ModelRunner.run`), on the thread count `forward` would pick.
        None where there is no fused kernel (`fused_decode`) or it declines the shapes."""
        if self.fused_decode is None:
            return None
        key = (True, len(rows.tokens).bit_length())
        threads = self._pick_threads(key, torch.get_num_threads())
        start = time.perf_counter()
        step = self.fused_decode.run(rows, kv_pool, threads)
        self.thread_choice.record(key, threads, time.perf_counter() - start)
        return step

    def _pick_threads(self, key, configured: int) -> int:
        if self.thread_choice is None or max(self.thread_choice.counts) != configured:
            self.thread_choice = ThreadChoice(configured, pinned=self.pin_threads)
        self.last_threads = self.thread_choice.pick(key)
        return self.last_threads

    def _step(self, input_ids, positions, meta, kv_pool, logits_rows) -> torch.Tensor:
        every_row_samples = logits_rows.shape[0] == input_ids.shape[0]
        if self.fused_decode is not None and not meta.prefill_chunks and every_row_samples:
            rows = DecodeRows.of_step(input_ids, positions, meta)
            step = self.fused_decode.run(rows, kv_pool, torch.get_num_threads())
            if step is not None:
                return step.logits.clone()  # the fused buffer is reused; callers keep these
        self.ops.begin_step()
        hidden = self.ops.embed(input_ids, self.weights.embed)
        for index, layer in enumerate(self.weights.layers):
            self._layer(index, layer, hidden, positions, meta, kv_pool)
        hidden = hidden.index_select(0, logits_rows)
        logits = self.ops.norm_linear(hidden, self.weights.final_norm, self.weights.lm_head)
        return logits.float()

    def _layer(self, index: int, layer: LayerWeights, hidden, positions, meta, kv_pool) -> None:
        """One decoder layer; updates the float32 residual `hidden` in place."""
        ops = self.ops
        qkv = ops.norm_linear(hidden, layer.input_norm, layer.qkv)
        q, k, v = ops.rope_store(qkv, positions, self.rope, kv_pool, index, meta, self.heads)
        attn = self.attention.forward(q, k, v, kv_pool, index, meta, self.scale)
        ops.linear_add(attn, layer.o_proj, hidden)
        gate_up = ops.norm_linear(hidden, layer.post_norm, layer.gate_up)
        ops.glu_linear_add(gate_up, layer.down, hidden)
