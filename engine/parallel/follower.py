"""A follower rank of a tensor-parallel worker: its shard of the model, its KV pool,
and the loop that runs rank 0's steps.

Lifecycle: built at the worker's start, at the same time as rank 0's `LLMEngine` and
over the same `EngineConfig` (each rank reads only its slices of the checkpoint; the
ranks agree on the pool's block count, so block ids mean the same blocks on all of
them) -> `serve()` on a thread of its own: receive a step from rank 0
(`StepChannel.receive`), run the forward over its pool, meet the other ranks in the
forward's all-reduces and in the LM head's gather, wait for the next -> rank 0 sends
STOP, or a peer dies and the next collective raises (the worker is then dead as a
whole; its health check says so and the controller restarts every rank).

A follower has no scheduler, allocator, prefix cache or sampler: rank 0's decide for
all ranks. KV moves in and out of its pool through its own transport, told by rank 0
which blocks (the worker layer's business, not this one's).
"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.demo_model import resolve_model
from engine.kv_cache import KVCachePool, KVLayout
from engine.llm_engine import load_forward, size_pool, tp_config
from engine.memory_profile import DeviceSnapshot
from engine.model_spec import load_model_spec
from engine.parallel.capacity import check_weights_fit
from engine.parallel.group import TPGroup
from engine.parallel.shard import ModelShard
from engine.parallel.step_channel import StepChannel
from engine.threads import single_threaded

logger = logging.getLogger(__name__)


class FollowerEngine:
    """Rank `tp.rank` > 0 of a worker; rank 0 is an `LLMEngine` over the same group."""

    def __init__(self, config: EngineConfig, tp: TPGroup):
        if tp.rank == 0:
            raise ValueError("rank 0 of a TP worker is its LLMEngine, not a follower")
        config = tp_config(config, tp)
        self.config = config
        self.tp = tp
        self.num_threads = config.num_threads or torch.get_num_threads()
        self.model_dir, self.model_id = resolve_model(config.model)
        self.spec = load_model_spec(self.model_dir, self.model_id)
        self.max_model_len = min(
            config.max_model_len or self.spec.context_window, self.spec.context_window
        )
        check_weights_fit(
            self.spec,
            ModelShard.of(self.spec, self.tp.size, self.tp.rank),
            config.torch_dtype.itemsize,
            config.device,
            config.gpu_memory_utilization,
        )
        baseline = DeviceSnapshot.take(config.device) if config.sizes_kv_from_device else None
        self.model = load_forward(
            config,
            self.model_dir,
            self.spec,
            self.max_model_len,
            tp,
            config.kernels,
            config.attention_backend,
        )
        self.layout = KVLayout.for_model(
            self.spec, self.model.kv_dtype, config.block_size, self.model.shard
        )
        num_blocks = config.fixed_kv_blocks
        if baseline is not None:
            num_blocks = size_pool(
                self.model, self.layout, config, self.max_model_len, baseline
            ).num_blocks
        num_blocks = tp.all_min(num_blocks)  # the same call as rank 0's, in the same order
        with single_threaded():
            self.kv_pool = KVCachePool(self.layout, num_blocks, config.device)
        self.channel = StepChannel(tp)
        self.steps = 0

    def serve(self) -> None:
        """Run rank 0's steps until it sends STOP; raises when a peer died (a collective
        failed). Called once, on the thread that owns this rank's torch threads."""
        torch.set_num_threads(self.num_threads)
        while True:
            step = self.channel.receive()
            if step is None:
                logger.info("tp rank %d: stopped after %d steps", self.tp.rank, self.steps)
                return
            self.model.forward(
                step.input_ids, step.positions, step.meta, self.kv_pool, step.logits_rows
            )
            self.steps += 1
