"""The decoder forward of every served architecture (engine/architectures.py) over the
paged KV pool: Llama's layer, with each family's traits switched on by the spec.

Tokens of all sequences in a step are packed into one [T, hidden] batch so the
projections run as large matmuls; only attention looks at sequence boundaries
(see `engine.attention`). Logits are computed only for the rows a sampler needs.

Each layer is written in a few grouped operations (`engine.layer_ops`); which
implementation runs them is chosen once at load (`kernels`): the native float32 CPU
kernels (`engine.native`), which fuse each group into one call and stream weights
packed for them, or the torch reference (any device, any dtype). With native ops and
native attention, a decode-only step of a plain Llama-shaped model runs as one native
call (`FusedDecode`); a model with any other trait (q/k norms, Gemma's norms, GELU,
soft-capping, experts, a sliding window shorter than the context) runs layer by layer,
its extra steps in torch ops on the same tensors (`engine.layer_ops.project`,
`rms_norm`, `engine.moe`), and its windowed or soft-capped layers on the reference
attention (`engine.masked_attention`) whatever the backend.

Tensor parallelism (`tp`, engine/parallel/): the same code runs a rank's shard of the
model (engine/parallel/shard.py says which heads, intermediate slice and vocabulary rows
it holds, and the loader reads only those). The projections are simply narrower; the
row-parallel ones (o, down, and a mixture's experts) add into zeros, whose sum over the
ranks one all-reduce makes before the residual add (`_add_reduced`); the embedding is
vocab-parallel (rows of other ranks look up zeros, then the all-reduce) and the LM head
computes each rank's vocabulary slice, gathered (`_logits`). Norms that follow a
projection (Gemma's) run on the reduced sum. The fused native decode step cannot stop
for an all-reduce, so a rank of several runs layer by layer.

The residual stream stays in float32 whatever the weights' dtype: with bf16 weights,
a bf16 residual (8-bit mantissa) drops layer updates that are small next to its
outliers (SmolLM2 reaches ~25000, where one bf16 step is 128): on the demo model the
hidden states after layer 20 were 2.9% off the fp32 reference with a bf16 residual,
2.1% with this one. Matmuls still run in the weights' dtype; only the [tokens, hidden]
adds and norms run in float32.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from pathlib import Path

import torch

from engine.attention import (
    AttentionBackend,
    AttentionChoice,
    AttentionMetadata,
    TorchPagedAttention,
    make_attention_backend,
)
from engine.kv_cache import KVCachePool
from engine.layer_ops import (
    RESIDUAL_DTYPE,
    HeadSizes,
    KernelChoice,
    TorchOps,
    activation_dtype,
    glu,
    make_layer_ops,
    project,
    rms_norm,
)
from engine.model_spec import ModelSpec
from engine.moe import moe_mlp
from engine.native.decode_step import DecodeRows, FusedDecode, FusedStep
from engine.parallel.group import TPGroup
from engine.parallel.shard import ModelShard
from engine.rope import RotaryEmbedding
from engine.threads import ThreadChoice
from engine.weight_cache import load_prepared_weights
from engine.weights import LayerWeights

__all__ = ["RESIDUAL_DTYPE", "LlamaForward"]
logger = logging.getLogger(__name__)


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
        tp: TPGroup | None = None,
    ):
        """`deterministic`: batch-invariant layer ops and attention (the `deterministic`
        setting); raises ValueError where this device and these choices have none.
        `tp`: this rank's tensor-parallel group (None: the whole model here)."""
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.deterministic = deterministic
        self.tp = tp or TPGroup.single(device)
        self.shard = ModelShard.of(spec, self.tp.size, self.tp.rank)
        """The heads, intermediate and vocabulary rows this rank holds (all of them on
        a single rank)."""
        if self.tp.parallel:
            logger.info("%s: %s", spec.model_id, self.shard.describe())
        if attention == "triton" and kernels == "auto":
            # The GPU path whole, wherever it runs: torch's layer ops and the Triton KV
            # store (on a CPU, the interpreter's debug mode; not the native kernels).
            kernels = "torch"
        self.ops = make_layer_ops(kernels, dtype, device, spec.rms_norm_eps, deterministic)
        self.activation_dtype = activation_dtype(kernels, dtype, device)
        """Of the activations: float32 on the native kernels, whose bf16 mode keeps the
        projections' weights (and, by default, the KV cache) in bf16."""
        self.weights = load_prepared_weights(
            Path(model_dir), spec, self.activation_dtype, device, self.ops, self.shard
        )
        max_positions = max_positions or spec.max_position_embeddings
        self.ropes = self._rotary_tables(max_positions)
        """Per layer: its rotary table (one shared by all, or one per layer type)."""
        self.rope = self.ropes[0]
        self.windows = spec.windows_within(max_positions)
        """Per layer: its sliding window, None where it attends to everything."""
        self.attention_options = [self._attention_options(w) for w in self.windows]
        self.unwindowed_options = [self._attention_options(None) for _ in self.windows]
        """The same for a step whose sequences all fit the narrowest window, where a
        window changes nothing (`_windows_apply`)."""
        self.min_window = min((w for w in self.windows if w is not None), default=None)
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
        self.attention = self._backend_for_options(attention)
        if self.attention.kv_store is not None and isinstance(self.ops, TorchOps):
            self.ops.use_kv_store(self.attention.kv_store)
        self.embed_scale = self._embed_scale()
        self.kv_dtype = kv_dtype or dtype
        """Of the KV pool this forward writes and reads: the weights' dtype unless asked
        otherwise; one that differs from the activations' needs the native kernels."""
        self._check_kv_dtype()
        self._check_deterministic()
        self.scale = spec.attention_scale
        self.heads = HeadSizes(self.shard.heads.q.count, self.shard.heads.kv.count, spec.head_dim)
        """This rank's heads (all of them on a single rank)."""
        self.thread_choice: ThreadChoice | None = None
        self.pin_threads = False
        """True: every step runs on torch's configured thread count (benchmarks)."""
        self.last_threads = 0
        """Threads the latest native CPU step ran on (0: not chosen), for the step trace."""
        self.fused_decode: FusedDecode | None = None
        """The one-call native decode step; never on a tensor-parallel rank, whose layers
        meet their peers' in an all-reduce between projections."""
        native = self.ops.name == "native" and attention.name == "native"
        if native and self._plain_llama() and not self.tp.parallel:
            self.fused_decode = FusedDecode(self.ops.kernels, self)

    def _rotary_tables(self, max_positions: int) -> list[RotaryEmbedding]:
        spec = self.spec
        if not spec.layer_rope_types:
            table = RotaryEmbedding(
                spec.hf_config, max_positions, self.activation_dtype, self.device
            )
            return [table] * spec.num_layers
        tables = {
            kind: RotaryEmbedding(
                spec.hf_config, max_positions, self.activation_dtype, self.device, kind
            )
            for kind in sorted(set(spec.layer_rope_types))
        }
        return [tables[kind] for kind in spec.layer_rope_types]

    def _attention_options(self, window: int | None) -> dict:
        """The keywords a layer's attention call adds: only those set, so a backend
        that knows neither serves the models that need neither."""
        options = {} if window is None else {"window": window}
        if self.spec.attn_softcap is not None:
            options["softcap"] = self.spec.attn_softcap
        return options

    def _backend_for_options(self, attention: AttentionBackend) -> AttentionBackend:
        """`attention`, or the torch reference when some layer needs a keyword (window,
        softcap) that backend's `forward` does not take."""
        needed = {name for options in self.attention_options for name in options}
        taken = inspect.signature(attention.forward).parameters
        missing = sorted(name for name in needed if name not in taken)
        if not missing:
            return attention
        logger.warning(
            "attention backend %s takes no %s, which %s needs: using torch attention",
            attention.name,
            "/".join(missing),
            self.spec.architecture,
        )
        return TorchPagedAttention()

    def _embed_scale(self) -> float | None:
        """Gemma scales the embeddings by sqrt(hidden_size), rounded to the weights' dtype
        as transformers rounds it."""
        if not self.spec.gemma_norms:
            return None
        return torch.tensor(math.sqrt(self.spec.hidden_size), dtype=self.dtype).item()

    def _plain_llama(self) -> bool:
        """Whether the fused native decode step computes this model: Llama's layer with
        nothing added (it knows q/k/v and o biases and any single rotary table). A
        sliding window does not stop it: steps whose sequences all fit the window are
        exact on it, and `decode` declines the others."""
        spec = self.spec
        return not (
            spec.qk_norm
            or spec.gemma_norms
            or spec.experts is not None
            or spec.activation != "silu"
            or spec.attn_softcap is not None
            or spec.final_softcap is not None
            or spec.layer_rope_types
        )

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: not with a sliding
        window or experts, whose steps read sizes back to the host (window starts,
        tokens per expert), nor on a tensor-parallel rank (its all-reduces are not
        captured)."""
        return self.min_window is None and self.spec.experts is None and not self.tp.parallel

    def _windows_apply(self, longest_context: int) -> bool:
        """Whether some layer's window hides a key from some query of a step whose
        longest sequence has `longest_context` tokens: the last query, at position
        longest - 1, sees (longest - 1 - window, ...], all of it while longest <= window."""
        return self.min_window is not None and longest_context > self.min_window

    def rope_offset(self, prompt_len: int) -> int:
        """Added to a sequence's positions for its rotary rows (LongRoPE's long prompts:
        `RotaryEmbedding.row_offset`); 0 for every other model."""
        return self.rope.row_offset(prompt_len)

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
        if self.fused_decode is None or self._windows_apply(max(rows.context_lens)):
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
        windowed = self.min_window is not None and self._windows_apply(_longest(meta))
        fused = self.fused_decode is not None and not windowed
        if fused and not meta.prefill_chunks and every_row_samples:
            rows = DecodeRows.of_step(input_ids, positions, meta)
            step = self.fused_decode.run(rows, kv_pool, torch.get_num_threads())
            if step is not None:
                return step.logits.clone()  # the fused buffer is reused; callers keep these
        self.ops.begin_step()
        hidden = self._embed(input_ids)
        if self.embed_scale is not None:
            hidden *= self.embed_scale
        options = self.attention_options if windowed else self.unwindowed_options
        for index, layer in enumerate(self.weights.layers):
            self._layer(index, layer, hidden, positions, meta, kv_pool, options[index])
        logits = self._logits(hidden.index_select(0, logits_rows))
        if self.spec.final_softcap is not None:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _layer(
        self, index: int, layer: LayerWeights, hidden, positions, meta, kv_pool, options: dict
    ) -> None:
        """One decoder layer; updates the float32 residual `hidden` in place. `options`:
        the keywords of its attention call (window, softcap)."""
        ops = self.ops
        qkv = ops.norm_linear(hidden, layer.input_norm, layer.qkv)
        if layer.q_norm is not None:
            self._norm_heads(qkv, layer)
        rope = self.ropes[index]
        q, k, v = ops.rope_store(qkv, positions, rope, kv_pool, index, meta, self.heads)
        attn = self.attention.forward(q, k, v, kv_pool, index, meta, self.scale, **options)
        if layer.attn_out_norm is None:
            self._add_reduced(lambda out: ops.linear_add(attn, layer.o_proj, out), hidden)
        else:
            out = self.tp.all_reduce(project(ops, attn, layer.o_proj))
            hidden += rms_norm(out, layer.attn_out_norm, self._eps)
        self._mlp(layer, hidden)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The float32 residual's first value. Vocab-parallel on a TP rank: each rank
        looks up the ids its rows hold, zeros for the others, and the sum over the
        ranks is every id's row."""
        if not self.tp.parallel:
            return self.ops.embed(input_ids, self.weights.embed)
        rows = self.shard.vocab.real
        local = input_ids - rows.start
        outside = (local < 0) | (local >= rows.count)
        hidden = self.ops.embed(local.masked_fill(outside, 0), self.weights.embed)
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the final hidden states: on a TP rank, each
        rank's vocabulary slice, gathered (the padding past the vocabulary cut)."""
        if self.tp.parallel and hidden.shape[0] == 0:  # every rank skips the gather alike
            return torch.empty(0, self.spec.vocab_size, device=hidden.device)
        logits = self.ops.norm_linear(hidden, self.weights.final_norm, self.weights.lm_head)
        logits = logits.float()
        if self.tp.parallel:
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.spec.vocab_size]
        return logits

    def _add_reduced(self, accumulate, hidden: torch.Tensor) -> None:
        """`hidden += ` a row-parallel projection's output, which `accumulate(out)` adds
        into `out`: straight into the residual on a single rank; on a TP rank into zeros,
        summed over the ranks, then added (each rank holds a partial sum)."""
        if not self.tp.parallel:
            accumulate(hidden)
            return
        partial = torch.zeros_like(hidden)
        accumulate(partial)
        hidden += self.tp.all_reduce(partial)

    @property
    def _eps(self) -> float:
        return self.spec.rms_norm_eps

    def _norm_heads(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """RMSNorm over each head of q and of k, in place in the qkv rows (before rotation)."""
        heads, rows = self.heads, qkv.shape[0]
        q_width = heads.num_heads * heads.head_dim
        k_width = heads.num_kv_heads * heads.head_dim
        for start, width, count, weight in (
            (0, q_width, heads.num_heads, layer.q_norm),
            (q_width, k_width, heads.num_kv_heads, layer.k_norm),
        ):
            part = qkv[:, start : start + width].view(rows, count, heads.head_dim)
            qkv[:, start : start + width] = rms_norm(part, weight, self._eps).view(rows, width)

    def _mlp(self, layer: LayerWeights, hidden: torch.Tensor) -> None:
        """The MLP (dense or mixture) and its residual add, in place in `hidden`."""
        ops, spec = self.ops, self.spec
        if layer.router is not None:
            normed = rms_norm(hidden, layer.post_norm, self._eps)
            hidden += self.tp.all_reduce(moe_mlp(ops, normed, layer, spec.experts, spec.activation))
            return
        gate_up = ops.norm_linear(hidden, layer.post_norm, layer.gate_up)
        if spec.activation == "silu" and layer.mlp_out_norm is None:
            self._add_reduced(lambda out: ops.glu_linear_add(gate_up, layer.down, out), hidden)
            return
        out = self.tp.all_reduce(project(ops, glu(gate_up, spec.activation), layer.down))
        if layer.mlp_out_norm is not None:
            out = rms_norm(out, layer.mlp_out_norm, self._eps)
        hidden += out


def _longest(meta: AttentionMetadata) -> int:
    """Tokens of the longest sequence in a step, its new ones included."""
    longest = 0
    if meta.num_decode_tokens:
        longest = int(meta.decode_context_lens.max())
    for chunk in meta.prefill_chunks:
        longest = max(longest, chunk.context_start + chunk.query_len)
    return longest
