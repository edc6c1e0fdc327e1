"""The Python API: start a cluster, stream generations, shut it down.

cluster = PDCluster(ClusterConfig(model="demo"))
await cluster.start()
async for chunk in cluster.generate("Hello", SamplingParams(max_tokens=16)):
    print(chunk.text, end="")
await cluster.shutdown()

Callers that must react to their own client going away (the HTTP frontend) split
`generate` in two: `open_request` admits the request and returns its owner, `run`
streams it, and `ClusterRequest.close` may be called from outside at any time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from cluster.config import ClusterConfig, ConfigError, PoolName
from cluster.control.controller import Controller
from cluster.flow.request import CloseReason, ClusterRequest, GenerationChunk
from cluster.flow.request_flow import RequestFlow
from cluster.flow.router import Router
from cluster.timeline import RequestTimeline
from engine import envs
from engine.block_manager import blocks_needed
from engine.demo_model import resolve_model
from engine.errors import InvalidRequestError
from engine.kv_cache import KVLayout
from engine.model_spec import load_model_spec
from engine.parallel.capacity import shard_parameters
from engine.parallel.shard import ModelShard
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


class RequestTimeoutError(TimeoutError):
    """A request ran past `request_timeout_s`; it was aborted on its workers."""

    def __init__(self, request_id: str, timeout_s: float):
        self.request_id = request_id
        super().__init__(f"[request {request_id}] exceeded request_timeout_s={timeout_s}")


class PDCluster:
    """Owned by one driver process (the HTTP frontend, a test, a script)."""

    def __init__(self, config: ClusterConfig):
        if not config.transport.token:
            token = envs.cluster_token() or secrets.token_hex(16)
            config = config.replace(transport={"token": token})
        self.config = config
        model_dir, self.model_id = resolve_model(config.model)
        self.tokenizer = Tokenizer(model_dir)
        self.tokenizer.prepare_chat_template()
        spec = load_model_spec(model_dir, self.model_id)
        context = spec.context_window
        self.max_model_len = min(config.max_model_len or context, context)
        config.check_pools(self.max_model_len)
        config.check_tp(spec)
        self.spec = spec
        self._fixed_blocks = {
            role: config.engine_config(role).usable_kv_blocks for role in config.roles_in_use
        }
        self.controller = Controller(config)
        self.router = Router(config.router_policy, self.controller.workers)
        self.flow = RequestFlow(config, self.router, self.controller.mark_dead)
        kv_dtype = config.engine_config("decode").kv_torch_dtype
        self.flow.disaggregation.costs.block_bytes = KVLayout.for_model(
            spec, kv_dtype, config.block_size
        ).block_nbytes
        self.on_finish: list[Callable[[ClusterRequest], None]] = [
            lambda req: self.flow.costs.observe(req.timeline),
            lambda req: self.flow.disaggregation.costs.observe(req.timeline),
            self._remember_decoded,
        ]
        """Observers (metrics, the recovery cost model), called once per request however
        it ended (finished, failed, cancelled, timed out), with the closed request."""
        self._ids = itertools.count()

    def rank_capacity(self) -> list[str]:
        """One line per pool: what each rank of its workers holds, weights and KV pool, in
        bytes (`pdserve serve` prints them at start-up); a pool its workers size from the
        device says so, and `sized_pool_capacity` has its blocks after start."""
        lines = []
        for role in self.config.roles_in_use:
            engine, tp = self.config.engine_config(role), self.config.pool(role).tp
            shard = ModelShard.of(self.spec, tp, 0)
            weights = shard_parameters(self.spec, shard) * engine.torch_dtype.itemsize
            layout = KVLayout.for_model(self.spec, engine.kv_torch_dtype, engine.block_size, shard)
            block = _mib(layout.block_nbytes)
            if engine.num_kv_blocks is None:
                kv = (
                    f"blocks of {block} sized at start from gpu_memory_utilization "
                    f"{engine.gpu_memory_utilization:g}"
                )
            else:
                total = _mib(layout.block_nbytes * engine.num_kv_blocks)
                kv = f"{engine.num_kv_blocks} blocks x {block} = {total}"
            lines.append(
                f"{self._pool_label(role)} workers: tp={tp}, per rank: weights {_mib(weights)}, "
                f"KV {kv} ({layout.num_kv_heads} of {self.spec.num_kv_heads} KV heads)"
            )
        return lines

    def sized_pool_capacity(self) -> list[str]:
        """One line per pool its workers sized from the device, once started: the blocks
        each worker can hand out (the fewest any reported) and how many `max_model_len`
        sequences fit at once (`pdserve serve` prints them after start)."""
        lines = []
        for role in self.config.roles_in_use:
            blocks = self.controller.kv_capacity(role)
            if self.config.kv_blocks(role) is not None or blocks is None:
                continue
            per_seq = self.config.blocks_per_sequence(self.max_model_len)
            lines.append(
                f"{self._pool_label(role)} workers: KV sized from gpu_memory_utilization "
                f"{self.config.gpu_memory_utilization:g}: {blocks} blocks of "
                f"{self.config.block_size} tokens per worker, at most {blocks // per_seq} "
                f"concurrent {self.max_model_len}-token sequences"
            )
        return lines

    def pool_blocks(self, role: PoolName) -> int | None:
        """Blocks a worker of `role`'s pool can hand out: the config's count less the
        CUDA graphs' scratch, or what a pool sized from the device reported (None
        before it has)."""
        fixed = self._fixed_blocks.get(role)
        return fixed if fixed is not None else self.controller.kv_capacity(role)

    def _pool_label(self, role: PoolName) -> str:
        return "colocated" if self.config.mode == "colocated" else role

    def _remember_decoded(self, req: ClusterRequest) -> None:
        """Its decode worker now caches the prompt and all outputs but the last (whose KV
        was never computed): the conversation's next turn is routed there."""
        self.router.remember_decoded(
            req.timeline.decode_worker, req.kv_tokens, req.params.cache_salt
        )

    async def start(self) -> PDCluster:
        """Start the workers; then refuse (stopping them) a pool they sized from the device
        too small for one `max_model_len` sequence, as `check_pools` does fixed ones."""
        await self.controller.start()
        try:
            self._check_sized_pools()
        except ConfigError:
            await self.controller.shutdown()
            raise
        return self

    def _check_sized_pools(self) -> None:
        for role in self.config.roles_in_use:
            blocks = self.controller.kv_capacity(role)
            if self.config.kv_blocks(role) is None and blocks is not None:
                self.config.check_reported_pool(role, blocks, self.max_model_len)

    async def shutdown(self) -> None:
        self.flow.streams.close()
        await self.controller.shutdown()

    async def __aenter__(self) -> PDCluster:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    # --- requests -----------------------------------------------------------------------

    def open_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> ClusterRequest:
        """Admit a request (text prompts are tokenized here, no chat template); raises
        InvalidRequestError for one that no worker of this cluster could ever serve."""
        request_id = request_id or self.new_request_id()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_fits(request_id, prompt_ids, params)
        req = ClusterRequest(
            request_id, prompt_ids, params, RequestTimeline(request_id, time.monotonic())
        )
        req.on_close.extend(self.on_finish)
        return req

    def check_fits(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty", request_id)
        wanted = len(prompt_ids) + params.max_tokens
        if wanted > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request needs {wanted} ({len(prompt_ids)} prompt + {params.max_tokens} "
                "max_tokens)",
                request_id,
            )
        pools = {"decode": (self.pool_blocks("decode"), wanted)}
        if self.config.mode == "disaggregated":
            pools["prefill"] = (self.pool_blocks("prefill"), len(prompt_ids) + 1)
        for role, (blocks, tokens) in pools.items():
            # A pool not yet sized (before start): its engine refuses the request itself.
            if blocks is not None and blocks_needed(tokens, self.config.block_size) > blocks:
                raise InvalidRequestError(
                    f"{tokens} tokens do not fit a {role} worker's KV pool ({blocks} blocks "
                    f"of {self.config.block_size})",
                    request_id,
                )

    async def run(self, req: ClusterRequest) -> AsyncIterator[GenerationChunk]:
        """Stream an opened request, and close it when the stream ends, however it ends.
        Raises `RequestTimeoutError` past `request_timeout_s` (the request is aborted)."""
        deadline = time.monotonic() + self.config.request_timeout_s
        stream = self.flow.run(req)
        reason = CloseReason.ERROR
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(stream), deadline - time.monotonic())
                except StopAsyncIteration:
                    reason = CloseReason.FINISHED
                    return
                except asyncio.TimeoutError:
                    reason = CloseReason.TIMEOUT
                    raise RequestTimeoutError(
                        req.request_id, self.config.request_timeout_s
                    ) from None
                yield self._stamp(req, chunk)
        except (GeneratorExit, asyncio.CancelledError):
            reason = CloseReason.CANCELLED
            raise
        finally:
            await stream.aclose()
            req.close(reason)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream a generation: `open_request` then `run`."""
        req = self.open_request(prompt, params, request_id)
        async for chunk in self.run(req):
            yield chunk

    @staticmethod
    def _stamp(req: ClusterRequest, chunk: GenerationChunk) -> GenerationChunk:
        timeline = req.timeline
        now = time.monotonic()
        timeline.stamp_token(now, len(chunk.token_ids))
        timeline.num_output_tokens = chunk.num_output_tokens
        chunk.num_prompt_tokens = len(req.prompt_ids)
        if chunk.finished:
            timeline.finish = now
            chunk.timings = timeline.breakdown()
        req.last_chunk = chunk
        return chunk
